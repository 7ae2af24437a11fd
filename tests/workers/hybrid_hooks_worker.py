"""The spike scaler and the telemetry on a Mix-LN HybridModel: the helpers of
tests/test_hybrid_training_hooks.py, and its torchrun worker.

    python -m torch.distributed.run --nproc_per_node 2 hybrid_hooks_worker.py --phase pp2 --workdir DIR

A tiny Mix-LN model of L = 4 blocks, P = 2 (boundary blocks 2 and 3), local backend, untied
output layer, trained STEPS steps with megatron's DDP, Adam (no clipping: elementwise, so the
same gradients give the same weights in every layout) and the pipeline schedule. Both hooks are
installed by install_training_hooks (hybrid=True for the HybridModel), the telemetry every step.
At INJECT's steps chosen target gradient elements are set to 1000x their tensor's mean |g| in a
finalize function that the scaler's hook wraps, so the scaler sees them as it would a real spike.
Names of norms: `layer<block>.norm<1|2>.weight` in both model kinds, found here from the layers
(block_number and the roles of norm_parameters()), independently of the scaler's own lookup.

Phase pp2 (2 procs): DIR/base (the hybrid model's initial weights, saved at PP1 by the test) is
loaded into a PP2 HybridModel split between blocks (`*-*-|*-*-`: block 2 on stage 0, block 3 on
stage 1) and inside block 3 (`*-*-*|-*-`: its norm1 on stage 0, its norm2 on stage 1); each trains
STEPS steps and saves model + optimizer + spike state after SAVE_AT. The inside-block save is then
loaded at PP1 (DP2) and trained on from step SAVE_AT + 1. Rank 0 writes DIR/hybrid_pp2.json.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCKS = 4
POST_LN = 2
PATTERN = "*-" * BLOCKS
SPLITS = {"between_blocks": "*-*-|*-*-", "inside_block": "*-*-*|-*-"}
STEPS = 6
SAVE_AT = 3
SPIKE = dict(threshold=50.0, beta=0.9, warmup_steps=3, log_interval=STEPS)
# step -> [(target, element)]: the scaler is warm from step 4 (3 committed steps) on.
INJECT = {
    4: [("layer2.norm2.weight", 5), ("layer3.norm1.weight", 7)],
    6: [("layer2.norm1.weight", 11), ("layer3.norm2.weight", 2)],
}
BOUNDARY_NAMES = [f"layer{b}.norm{i}.weight" for b in (2, 3) for i in (1, 2)]


# ------------------------------------------------------------------ models
def settings(telemetry_path):
    from mixln_megatron.model.settings import MixLNSettings, SpikeSettings, TelemetrySettings

    return MixLNSettings(post_ln_layers=POST_LN, spike=SpikeSettings(enabled=True, **SPIKE),
                         telemetry=TelemetrySettings(interval=1, path=telemetry_path))


def build(kind, telemetry_path, pattern=PATTERN, pp=1):
    """(config, model) of this pipeline stage, the hooks installed on the config before the build
    (Megatron-LM's order)."""
    from harness.testing import build_gpt, build_hybrid, tiny_config
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec
    from mixln_megatron.training.hooks import install_training_hooks

    s = settings(telemetry_path)
    hybrid = kind == "hybrid"
    config = tiny_config(num_layers=2 * BLOCKS if hybrid else BLOCKS, pp=pp)
    install_training_hooks(config, s, hybrid=hybrid)
    if hybrid:
        return config, build_hybrid(config, get_mixln_hybrid_stack_spec(config, backend="local", settings=s),
                                    pattern, untie=True)
    return config, build_gpt(config, get_mixln_decoder_block_spec(config, backend="local", settings=s), untie=True)


def gpt_to_hybrid_name(name: str) -> str:
    """GPT layer i (0-based): attention modules -> hybrid layer 2i, MLP modules -> 2i+1."""
    import re

    m = re.match(r"decoder\.layers\.(\d+)\.([^.]+)(.*)", name)
    if not m:
        return name.replace("decoder.final_layernorm", "decoder.final_norm")
    i, module, rest = int(m[1]), m[2], m[3]
    attention = module in ("input_layernorm", "self_attention", "post_attention_layernorm", "mixln_settings")
    return f"decoder.layers.{2 * i + (0 if attention else 1)}.{module}{rest}"


def copy_gpt_weights(gpt, hybrid) -> None:
    state = {gpt_to_hybrid_name(k): v for k, v in gpt.state_dict().items() if "_extra_state" not in k}
    missing, unexpected = hybrid.load_state_dict(state, strict=False)
    missing = [k for k in missing if "_extra_state" not in k]
    assert not missing and not unexpected, (missing, unexpected)


def norms_by_name(model) -> dict:
    """{`layer<block>.<role>`: parameter} of this stage's Mix-LN layers."""
    from mixln_megatron.model.layer import MixLNTransformerLayer

    return {f"layer{m.block_number}.{role}": p for m in model.modules() if isinstance(m, MixLNTransformerLayer)
            for role, p in m.norm_parameters()}


# ------------------------------------------------------------------ training
class Trainer:
    """One model chunk in megatron's DDP with Adam; records the scaler's decisions per step."""

    def __init__(self, config, model, first_step=1):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from mixln_megatron.training.spike import SpikeGradsHook, get_spike_scaler
        from mixln_megatron.training.telemetry import get_telemetry

        self.config, self.model = config, model
        self.chunk = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0, bf16=False, params_dtype=torch.float32),
            [self.chunk])
        self.scaler, self.telemetry = get_spike_scaler(config), get_telemetry(config)
        assert self.scaler is not None and self.telemetry is not None
        self.scaler.set_optimizer(self.optimizer)
        hook = config.finalize_model_grads_func  # telemetry(spike scaler(megatron's finalize))
        while not isinstance(hook, SpikeGradsHook):
            hook = hook.original
        hook.original = self._inject
        self.scaler.recorder = self._record
        self.step = first_step - 1
        self.decisions = {}  # step -> {target: [elements scaled]}
        self.replacements = {}  # step -> {target: [values they were scaled to]}

    def _inject(self, model, *args, **kwargs):
        from megatron.core.distributed import finalize_model_grads

        result = finalize_model_grads(model, *args, **kwargs)
        params = norms_by_name(self.model)
        for name, index in INJECT.get(self.step, []):
            if name in params:
                grad = params[name].main_grad.view(-1)
                grad[index] = 1000.0 * grad.abs().mean()
        return result

    def _record(self, scaler, grads, spike, replacement, scale, owned):
        for k, t in enumerate(scaler.targets):
            flagged = spike[k, :t.numel].nonzero().flatten().tolist()
            self.decisions.setdefault(self.step, {})[t.name] = flagged
            self.replacements.setdefault(self.step, {})[t.name] = replacement[k, flagged].tolist()

    def train(self, last_step):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from harness.testing import SEQ, batch

        while self.step < last_step:
            self.step += 1
            micro = [batch(seed=1000 + 10 * self.step + i) for i in range(2)]

            def forward_step(data_iterator, model):
                ids, labels, pos, mask = next(data_iterator)
                output = model(ids, pos, mask, labels=labels)
                return output, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

            self.chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.chunk,
                num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=2, forward_only=False)
            ok, _, _ = self.optimizer.step()
            assert ok, f"the optimizer skipped step {self.step}"

    def results(self) -> dict:
        """This rank's decisions and state, the telemetry rows and the scaler's totals (collective)."""
        scaler = self.scaler
        state = {t.name: [s["momentum"].tolist(), s["step"].double().tolist()]
                 for t, s in ((t, scaler.state.get_target(k)) for k, t in enumerate(scaler.targets))}
        records = [{k: r[k] for k in ("layer_grad_norm", "norm1_grad_norm", "norm2_grad_norm",
                                      "post_ln_group_grad_norm", "pre_ln_group_grad_norm", "spike")}
                   for r in self.telemetry.records]
        return {"decisions": {str(s): d for s, d in self.decisions.items()},
                "replacements": {str(s): d for s, d in self.replacements.items()},
                "state": state, "telemetry": records, "totals": scaler.totals(reduce=True),
                "targets": scaler.target_names()}


# ------------------------------------------------------------------ checkpoints
def spike_keys(model) -> list:
    """The global keys of the spike state in the model's sharded state dict."""
    return sorted(v.key for k, v in model.sharded_state_dict().items() if ".mixln_spike_scaler." in k)


def save(path, model, optimizer=None) -> None:
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=False)
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()


def load(path, model, optimizer=None) -> None:
    from megatron.core import dist_checkpointing

    request = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        request["optimizer"] = optimizer.sharded_state_dict(request["model"], is_loading=True)
    state = dist_checkpointing.load(request, path)
    model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def held_state(scaler) -> dict:
    """{target: [momentum, step]} the holders on this rank would save (their state after a load)."""
    return {name: [t.tolist() for t in pair] for name, pair in scaler.checkpoint.held_state().items()}


# ------------------------------------------------------------------ the pp2 phase
def gathered(value) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def run_split(workdir, name, pattern) -> dict:
    from megatron.core import parallel_state as ps

    from harness.testing import init_distributed

    init_distributed(pp=2)
    config, model = build("hybrid", os.path.join(workdir, f"{name}.jsonl"), pattern, pp=2)
    load(os.path.join(workdir, "base"), model)
    trainer = Trainer(config, model)
    trainer.train(SAVE_AT)
    save(os.path.join(workdir, f"{name}_step{SAVE_AT}"), model, trainer.optimizer)
    at_save = held_state(trainer.scaler)
    trainer.train(STEPS)
    return {"pp_rank": ps.get_pipeline_model_parallel_rank(),
            "layers": [(m.layer_number, m.block_number) for m in model.decoder.layers],
            "holders": sorted(trainer.scaler.checkpoint.holders), "spike_keys": spike_keys(model),
            "at_save": at_save, **trainer.results()}


def resume_at_pp1(workdir, name) -> dict:
    from harness.testing import init_distributed

    init_distributed(pp=1)  # DP2: both ranks see the same micro-batches, so the same gradients
    config, model = build("hybrid", os.path.join(workdir, f"{name}_resumed.jsonl"))
    trainer = Trainer(config, model, first_step=SAVE_AT + 1)
    load(os.path.join(workdir, f"{name}_step{SAVE_AT}"), model, trainer.optimizer)
    after_load = held_state(trainer.scaler)
    trainer.train(STEPS)
    return {"after_load": after_load, "spike_keys": spike_keys(model), **trainer.results()}


def phase_pp2(workdir) -> dict:
    out = {name: gathered(run_split(workdir, name, pattern)) for name, pattern in SPLITS.items()}
    out["inside_block_resumed_pp1"] = gathered(resume_at_pp1(workdir, "inside_block"))
    return out


if __name__ == "__main__":
    from parallel_worker import run_phase

    run_phase({"pp2": phase_pp2}, "hybrid_")
