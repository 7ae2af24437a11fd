"""torchrun worker: logged per-layer gradient norms equal norms computed from the gradients.

Phases: reference (1 proc: base checkpoint; direct norms at TP1PP1 and the telemetry of the
same step), world2 (DP2 with and without the distributed optimizer, TP2, PP2), world4 (TP2xPP2
with and without it). The reference runs as one plain process, the others under torchrun. Rank 0 writes DIR/telemetry_<phase>.json.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


from parallel_worker import Run, run_phase  # noqa: E402


def direct_norms(run):
    """Per-layer norms straight from main_grad; valid at TP1 PP1 without the distributed optimizer."""
    from mixln_megatron.model.layer import MixLNTransformerLayer

    rows = {}
    for model in run.models:
        for layer in model.modules():
            if isinstance(layer, MixLNTransformerLayer):
                total = sum(p.main_grad.double().pow(2).sum() for p in layer.parameters())
                norms = {"norm1": 0.0, "norm2": 0.0}  # each of the two norms: all its parameters
                for role, p in layer.norm_parameters():
                    norms[role.split(".")[0]] += p.main_grad.double().pow(2).sum().item()
                rows[layer.layer_number] = [total.sqrt().item(), norms["norm1"] ** 0.5, norms["norm2"] ** 0.5]
    return [rows[k] for k in sorted(rows)]


def telemetry_step(run, path, capture_direct=False):
    from mixln_megatron.training.telemetry import install_telemetry

    telemetry = install_telemetry(run.cfg, interval=1, path=path)
    captured = {}
    if capture_direct:
        inner = run.cfg.finalize_model_grads_func

        def outer(model, *args, **kwargs):
            result = inner(model, *args, **kwargs)
            captured["direct"] = direct_norms(run)
            return result

        run.cfg.finalize_model_grads_func = outer
    run.train(steps=1, seed=500)
    record = telemetry.records[-1]
    out = {"logged": [list(r) for r in zip(record["layer_grad_norm"], record["norm1_grad_norm"],
                                             record["norm2_grad_norm"])],
           "post_group": record["post_ln_group_grad_norm"], "pre_group": record["pre_ln_group_grad_norm"]}
    out.update(captured)
    return out


def phase_reference(workdir):
    base = os.path.join(workdir, "base")
    trainer = Run(seed=3)
    trainer.train(steps=2, seed=17)
    trainer.save(base)
    out = {"tp1pp1": telemetry_step(Run(load=base), os.path.join(workdir, "t1.jsonl"), capture_direct=True)}

    # Every N steps only, after the spike scaler (installed first), whose counts join the records.
    from mixln_megatron.training.spike import install_spike_scaler
    from mixln_megatron.training.telemetry import install_telemetry

    run = Run(load=base)
    install_spike_scaler(run.chunks, run.cfg, run.optimizer, warmup_steps=1)
    path = os.path.join(workdir, "interval.jsonl")
    install_telemetry(run.cfg, interval=2, path=path)
    run.train(steps=5, seed=600)
    with open(path) as f:
        records = [json.loads(line) for line in f]
    out["interval_steps"] = [r["step"] for r in records]
    out["interval_has_spike"] = all("spike" in r for r in records)
    return out


def phase_world2(workdir):
    base = os.path.join(workdir, "base")
    return {
        "dp2": telemetry_step(Run(load=base), os.path.join(workdir, "t2.jsonl")),
        "dp2_distopt": telemetry_step(Run(load=base, distopt=True), os.path.join(workdir, "t3.jsonl")),
        "tp2": telemetry_step(Run(tp=2, load=base), os.path.join(workdir, "t6.jsonl")),
        "pp2": telemetry_step(Run(pp=2, load=base), os.path.join(workdir, "t7.jsonl")),
    }


def phase_world4(workdir):
    base = os.path.join(workdir, "base")
    return {
        "tp2pp2": telemetry_step(Run(tp=2, pp=2, load=base), os.path.join(workdir, "t4.jsonl")),
        "tp2pp2_distopt": telemetry_step(Run(tp=2, pp=2, load=base, distopt=True), os.path.join(workdir, "t5.jsonl")),
    }


if __name__ == "__main__":
    run_phase({"reference": phase_reference, "world2": phase_world2, "world4": phase_world4}, "telemetry_")
