"""torchrun worker (2 ranks): the training hooks on shapes the small tests never build.

Phases (rank 0 writes DIR/scale_hooks_<phase>.json):
  stock_spec  TP2 with one query group (megatron deep-copies the config for attention), the
              model built from the --spec object the way this release's pretrain_gpt.py builds
              it, every hook on from MIXLN_* (set by the test): 2 training steps; whether the
              attention's copy of the config drives the same scaler and telemetry.
  stock_spec_deepnorm  the same shape with a deepnorm layer: the --spec object refuses (exit 2).
  instances   DP2, distributed optimizer with 1 and then 2 optimizer instances, the same
              batches: the telemetry's records and the spike scaler's statistics and state.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parallel_worker import run_phase  # noqa: E402

from harness import testing as mu  # noqa: E402


def _stock_model(config):
    """The model pretrain_gpt.py builds from `--spec mixln_megatron.spec mixln_local_layer_spec`:
    0.19+ calls the imported function with the config, 0.17/0.18 hand the ModuleSpec to GPTModel."""
    from megatron.core.transformer.spec_utils import import_module

    from mixln_megatron import compat

    spec = import_module(("mixln_megatron.spec", "mixln_local_layer_spec"))
    return mu.build_gpt(config, spec(config, vp_stage=None) if compat.SPEC_GETS_THE_CONFIG else spec)


def phase_stock_spec(workdir):
    from megatron.training import global_vars

    from mixln_megatron.training.spike import get_spike_scaler
    from mixln_megatron.training.telemetry import get_telemetry

    mu.cpu.enable_training()
    mu.init_distributed(tp=2)
    global_vars._GLOBAL_ARGS = argparse.Namespace()  # what the edge reads: Megatron-LM's args (no --mixln-* flags)
    config = mu.tiny_config(tp=2, query_groups=1)
    model = _stock_model(config)
    scaler, telemetry = get_spike_scaler(config), get_telemetry(config)
    copies = [layer.self_attention.core_attention.config for layer in model.decoder.layers]
    losses, _ = mu.TinyTrainer(config, [model]).train(steps=2)
    return {
        "losses": losses,
        "kinds": [layer.kind for layer in model.decoder.layers],
        "norm_output_scale": [float(layer.norm_output_scale) for layer in model.decoder.layers],
        "config_copied": all(c is not config for c in copies),
        "copies_share_scaler": scaler is not None and all(get_spike_scaler(c) is scaler for c in copies),
        "copies_share_telemetry": telemetry is not None and all(get_telemetry(c) is telemetry for c in copies),
        "copies_build_callbacks": sorted({type(cb.__self__).__name__ + (":same" if cb.__self__ is scaler else ":other")
                                          for c in copies for cb in vars(c).get("_mixln_on_layer_built", ())}),
        "telemetry_rows": [len(r["layer_grad_norm"]) for r in telemetry.records],
        "spike_committed_steps": scaler.committed_steps,
        "spike_targets": scaler.target_names(),
    }


def phase_stock_spec_deepnorm(workdir):
    """DeepNorm with one query group at TP2 through the --spec object: refused before any layer is
    built, as the edge's Refusal (exit 2, the one line printed by the first rank that meets it)."""
    from megatron.training import global_vars

    mu.cpu.enable_training()
    mu.init_distributed(tp=2)
    global_vars._GLOBAL_ARGS = argparse.Namespace()
    config = mu.tiny_config(tp=2, query_groups=1)
    try:
        _stock_model(config)
    except SystemExit as refusal:
        return {"exit": refusal.code, "refusal": type(refusal).__name__}
    return {"exit": None}


def _instances_run(k, workdir):
    from mixln_megatron.training.spike import install_spike_scaler
    from mixln_megatron.training.telemetry import install_telemetry

    run = mu.MixLNRun(distopt=True, optimizer_instances=k, seed=11)
    scaler = install_spike_scaler(run.chunks, run.cfg, run.optimizer, warmup_steps=1, threshold=1.5,
                                  targets="all", log_interval=1000)
    telemetry = install_telemetry(run.cfg, interval=1, path=os.path.join(workdir, f"instances{k}.jsonl"))
    run.train(steps=3, seed=300)
    scaler.synchronize()
    return {
        "telemetry": [[r["layer_grad_norm"], r["norm1_grad_norm"], r["norm2_grad_norm"]] for r in telemetry.records],
        "spike_totals": scaler.totals(reduce=True),
        "spike_momentum": scaler.state.momentum.tolist(),
        "spike_step": scaler.state.step.tolist(),
    }


def phase_instances(workdir):
    return {f"k{k}": _instances_run(k, workdir) for k in (1, 2)}


if __name__ == "__main__":
    from fork_queue import fork_started_write_results_queue

    fork_started_write_results_queue()  # before any gloo thread: see fork_queue.py
    run_phase({"stock_spec": phase_stock_spec, "stock_spec_deepnorm": phase_stock_spec_deepnorm,
               "instances": phase_instances}, "scale_hooks_")
