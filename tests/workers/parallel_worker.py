"""torchrun worker: Mix-LN under TP / SP / PP / VPP / DP on CPU with gloo.

    python -m torch.distributed.run --nproc_per_node N parallel_worker.py --phase PHASE --workdir DIR
    python parallel_worker.py --phase reference --workdir DIR     (one process: no launcher needed)

Phases (one launch per world size; parallel state is re-initialised between layouts):
  reference (1 proc)  train a few steps, save the base checkpoint; TP1PP1 figures from it;
                      settings-mismatch and stock-checkpoint checks.
  world2    (2 procs) TP2, PP2, TP2+SP, PP2xVPP2, DP2 (distributed optimizer), placement checks;
                      save at TP2, load at PP2.
  world4    (4 procs) TP2xPP2, PP4 placement, uneven stages; save at TP2xPP2, load at TP1 (DP4).
Every rank writes nothing; rank 0 writes DIR/<phase>.json with what the test asserts on.
"""

import argparse
import json
import os
import sys
import traceback

import torch

from harness import testing


class Run(testing.MixLNRun):
    """One parallel layout (the harness's MixLNRun), with what the parallel tests check on it."""

    def layer_kinds(self):
        merged = testing.gathered_by_layer({l.layer_number: bool(l.is_post_ln) for m in self.models
                                            for l in m.decoder.layers})
        return list(merged.values()), list(merged)

    def post_ln_norms_identical_across_tp(self):
        """After SP steps, every Post-LN norm weight must be the same on every TP rank."""
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        same = True
        for m in self.models:
            for layer in m.decoder.layers:
                if not layer.is_post_ln:
                    continue
                for norm in (layer.post_attention_layernorm, layer.post_mlp_layernorm):
                    w = norm.weight.detach().clone()
                    parts = [torch.empty_like(w) for _ in range(ps.get_tensor_model_parallel_world_size())]
                    torch.distributed.all_gather(parts, w, group=group)
                    same &= all(torch.equal(parts[0], p) for p in parts)
        return bool(same)


def figures(run):
    eval_loss = run.eval_loss()
    losses, grad_norms = run.train()
    return {"eval": eval_loss, "losses": losses, "grad_norms": grad_norms}


def phase_reference(workdir):
    out = {}
    base = os.path.join(workdir, "base")
    trainer = Run(seed=1)
    trainer.train(steps=3, seed=7)  # weights that are not the initialisation
    testing.perturb_norms(trainer.models[0])  # norms away from 1 so that a wrong load would show
    trainer.save(base)
    out["tp1pp1"] = figures(Run(load=base))
    out["tp1pp1_rerun"] = figures(Run(load=base))
    out["tp1pp1_distopt"] = figures(Run(load=base, distopt=True))
    out["kinds_pp1"] = Run().layer_kinds()

    # LayerNorm Scaling on the Pre-LN layers of a Mix-LN model (scheme mixln+lns, P = 1).
    lns_dir = os.path.join(workdir, "base_lns")
    lns = Run(seed=2, scheme="mixln+lns", post_ln_layers=1)
    lns.train(steps=2, seed=11)
    lns.save(lns_dir)
    out["lns_tp1pp1"] = figures(Run(load=lns_dir, scheme="mixln+lns", post_ln_layers=1))
    try:
        Run(load=lns_dir, post_ln_layers=1)  # same P, scheme mixln: refused
        out["lns_scheme_mismatch"] = "no error"
    except BaseException as e:  # noqa: BLE001
        out["lns_scheme_mismatch"] = f"{type(e).__name__}: {e}"

    # A model with another P refuses the checkpoint, naming both settings (both record channels).
    for key, check in (("mismatch_metadata", True), ("mismatch_sharded", False)):
        try:
            Run(load=base, post_ln_layers=1, metadata_check=check)
            out[key] = "no error"
        except BaseException as e:  # noqa: BLE001 - dist_checkpointing errors derive from BaseException
            out[key] = f"{type(e).__name__}: {e}"

    # alpha = 0: a stock-spec checkpoint loads into the Mix-LN model and gives the same loss.
    stock_dir = os.path.join(workdir, "stock")
    stock = Run(stock=True, seed=5)
    stock.train(steps=2, seed=9)
    stock.save(stock_dir)
    out["stock_eval"] = Run(stock=True, load=stock_dir).eval_loss()
    out["stock_into_p0_eval"] = Run(post_ln_layers=0, load=stock_dir).eval_loss()
    # ... and a P = 0 Mix-LN checkpoint loads into the stock model.
    p0_dir = os.path.join(workdir, "p0")
    Run(post_ln_layers=0, load=stock_dir).save(p0_dir)
    out["p0_into_stock_eval"] = Run(stock=True, load=p0_dir).eval_loss()
    try:
        Run(post_ln_layers=2, load=stock_dir, metadata_check=False)
        out["stock_into_p2"] = "no error"
    except BaseException as e:  # noqa: BLE001
        out["stock_into_p2"] = f"{type(e).__name__}: {e}"
    return out


def phase_world2(workdir):
    base = os.path.join(workdir, "base")
    out = {}
    tp2 = Run(tp=2, load=base)
    resharded = os.path.join(workdir, "tp2")
    tp2.save(resharded)  # saved at TP2 as loaded (before its training steps), read at PP2 below
    out["tp2"] = figures(tp2)
    out["tp2_rerun"] = figures(Run(tp=2, load=base))
    sp = Run(tp=2, sp=True, load=base)
    out["tp2_sp"] = figures(sp)
    out["tp2_sp_norms_identical"] = sp.post_ln_norms_identical_across_tp()
    # Post-LN placement is fixed when a model is built: read it off the models that run the figures
    pp2 = Run(pp=2, load=base)
    out["kinds_pp2"] = pp2.layer_kinds()
    out["pp2"] = figures(pp2)
    pp2_vpp2 = Run(pp=2, vpp=2, load=base)
    out["kinds_pp2_vpp2"] = pp2_vpp2.layer_kinds()
    out["pp2_vpp2"] = figures(pp2_vpp2)
    out["dp2_distopt"] = figures(Run(load=base, distopt=True))
    out["tp2_distopt"] = figures(Run(tp=2, load=base, distopt=True))
    lns_dir = os.path.join(workdir, "base_lns")
    out["lns_tp2_sp"] = figures(Run(tp=2, sp=True, load=lns_dir, scheme="mixln+lns", post_ln_layers=1))
    out["lns_pp2"] = figures(Run(pp=2, load=lns_dir, scheme="mixln+lns", post_ln_layers=1))
    out["kinds_pp2_uneven"] = Run(pp=2, num_layers=6, post_ln_layers=3, num_layers_in_first_pipeline_stage=2,
                                  num_layers_in_last_pipeline_stage=4).layer_kinds()
    out["tp2_saved_pp2_eval"] = Run(pp=2, load=resharded).eval_loss()  # TP and PP both change
    return out


def phase_world4(workdir):
    base = os.path.join(workdir, "base")
    out = {}
    out["tp2pp2"] = figures(Run(tp=2, pp=2, load=base))
    out["kinds_pp4"] = Run(pp=4).layer_kinds()
    out["kinds_pp4_uneven"] = Run(pp=4, num_layers=6, post_ln_layers=3, num_layers_in_first_pipeline_stage=1,
                                  num_layers_in_last_pipeline_stage=1).layer_kinds()
    resharded = os.path.join(workdir, "tp2pp2")
    Run(tp=2, pp=2, load=base).save(resharded)
    out["tp2pp2_saved_tp1_eval"] = Run(load=resharded).eval_loss()  # TP1 PP1 (DP4) reads it back
    return out


def run_phase(phases: dict, result_prefix: str = "") -> None:
    """CLI of a phase worker: run `--phase`, rank 0 writes DIR/<prefix><phase>.json atomically."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", required=True, choices=sorted(phases))
    parser.add_argument("--workdir", required=True)
    a = parser.parse_args()
    try:
        out = phases[a.phase](a.workdir)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # a failed rank must not leave its peers waiting in a collective
    if torch.distributed.get_rank() == 0:
        name = f"{result_prefix}{a.phase}.json"
        tmp = os.path.join(a.workdir, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, os.path.join(a.workdir, name))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from fork_queue import fork_started_write_results_queue

    fork_started_write_results_queue()  # before any gloo thread: see fork_queue.py
    run_phase({"reference": phase_reference, "world2": phase_world2, "world4": phase_world4})
