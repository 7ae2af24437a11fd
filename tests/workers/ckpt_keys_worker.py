"""Save or load a model through Megatron-LM's own checkpointing (megatron.training, core 0.19.2 wheel).

    python ckpt_keys_worker.py STEP [--and STEP ...] [--then STEP [--and STEP ...] ...]
    STEP: SPEC [MIXLN_X=VALUE ...] ACTION DIR [ACTION DIR ...]
SPEC: "stock" (megatron's stock local spec) or "mixln" (--spec mixln_megatron.spec
mixln_local_layer_spec, settings from the MIXLN_* given, on top of the environment's). ACTION:
"save" (norm weights randomised first, so a wrong load shows) or "load"
(megatron.training.checkpointing.load_checkpoint at the default --dist-ckpt-strictness).

Each step is a process of its own (Megatron-LM's global args, one model): forked from this one
once it has imported megatron.training and the tokenizer libraries (what every step would
import again), as the test suite's fork server does for whole workers. Steps joined by --and run
at the same time, stages (--then) one after the other; a step that fails stops the run (exit 1).
Prints one line per action, step by step: `RESULT {"step": i, ...}` with the parameter sums
after it, or the error a load raised.
"""

import json
import os
import sys
import tempfile

ARGS_EXTRA = ["--ckpt-format", "torch_dist", "--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng"]


def sums(model):
    return {name: round(float(p.detach().double().sum()), 6) for name, p in model.named_parameters()}


def parse_plan(argv):
    """[[(spec, {MIXLN_X: value}, [(action, dir), ...]), ...], ...]: stages of concurrent steps."""
    stages, stage, words = [], [], []

    def close_step():
        assert words, f"an empty step in {argv}"
        spec, rest = words[0], words[1:]
        assert spec in ("stock", "mixln"), spec
        env = dict(w.split("=", 1) for w in rest if "=" in w)
        assert all(k.startswith("MIXLN_") for k in env), env
        actions = [w for w in rest if "=" not in w]
        assert actions and len(actions) % 2 == 0 and set(actions[::2]) <= {"save", "load"}, actions
        stage.append((spec, env, list(zip(actions[::2], actions[1::2]))))
        words.clear()

    for word in argv:
        if word in ("--and", "--then"):
            close_step()
            if word == "--then":
                stages.append(list(stage))
                stage.clear()
        else:
            words.append(word)
    close_step()
    stages.append(list(stage))
    return stages


def die_with(parent_pid):
    """A step must not outlive the worker (a test that times out kills the worker only)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the worker was gone before that
        os._exit(1)


def run_step(spec, env, actions, result_file, parent_pid):
    """One step, in a process of its own: what a fresh `python ckpt_keys_worker.py SPEC ...` did."""
    die_with(parent_pid)
    os.environ.update(env)
    if any(action == "save" for action, _ in actions):
        from fork_queue import fork_started_write_results_queue

        fork_started_write_results_queue()
    from mixln_megatron import cpu
    from harness import testing

    cpu.enable_training()
    testing.init_distributed()
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.training.models.gpt import GPTModelBuilder

    extra = ["--spec", "mixln_megatron.spec", "mixln_local_layer_spec"] if spec == "mixln" else []
    sys.argv = [sys.argv[0], *testing.TINY_MEGATRON_LM_ARGS, *ARGS_EXTRA, *extra]
    args = parse_and_validate_args()
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    layer_class = type(model.decoder.layers[0]).__name__
    results = []
    for action, directory in actions:
        out = {"action": action, "layer_class": layer_class,
               "post_ln": [l.layer_number for l in model.decoder.layers if getattr(l, "is_post_ln", False)]}
        if action == "save":
            g = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            args.save = directory
            save_checkpoint(1, [model], None, None, 0)
        else:
            args.load = directory
            try:
                load_checkpoint([model], None, None)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                out["error"] = f"{type(e).__name__}: {e}"
        out["sums"] = sums(model)
        results.append(out)
    with open(result_file, "w") as f:
        json.dump(results, f)
    sys.stdout.flush()


def main():
    stages = parse_plan(sys.argv[1:])
    # What every step imports: once here, not once per step (the steps are forked from here).
    import megatron.core.tokenizers.text  # noqa: F401  (NullTokenizer's build imports the HF libraries)
    import megatron.training.argument_utils  # noqa: F401
    import megatron.training.arguments  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    import megatron.training.models.gpt  # noqa: F401

    import mixln_megatron.spec  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="ckpt_keys_") as results_dir:
        run_stages(stages, results_dir)


def run_stages(stages, results_dir):
    """Fork a process per step, stage by stage; print the steps' results in step order."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    number = 0
    for stage in stages:
        procs = []
        for spec, env, actions in stage:
            result_file = os.path.join(results_dir, f"{number}.json")
            proc = fork.Process(target=run_step, args=(spec, env, actions, result_file, os.getpid()), name=f"step{number}")
            proc.start()
            procs.append((number, proc, result_file))
            number += 1
        for i, proc, _ in procs:
            proc.join()
        failed = [(i, proc.exitcode) for i, proc, _ in procs if proc.exitcode != 0]
        if failed:
            print(f"ckpt_keys_worker: steps failed (step, exit code): {failed}", flush=True)
            sys.exit(1)
        for i, _, result_file in procs:
            with open(result_file) as f:
                for out in json.load(f):
                    print("RESULT " + json.dumps({"step": i, **out}), flush=True)


if __name__ == "__main__":
    main()
