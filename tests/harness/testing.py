"""The development harness: gloo bootstrap, the tiny LLaMA config and a tiny training loop.

One place for what the tests, their torchrun workers and the benchmarks all need, so that none of
them carries its own copy (benchmarks put tests/ on sys.path to import it):
  - init_process_group / init_distributed: a torch.distributed group (torchrun's rendezvous when
    launched by it, else a one-process file store: no TCP port to race for) and megatron's
    parallel state; init_distributed also enters the CPU harness (mixln_megatron.cpu);
  - tiny_config / build_gpt / batch: a LLaMA-shaped megatron-core GPT small enough for 2 cores
    (RMSNorm, SwiGLU, RoPE, no biases, every CUDA-only fusion off);
  - TinyTrainer: megatron's DDP, its optimizer and its pipeline schedule over model chunks, the
    loop Megatron-LM runs, without Megatron-LM's entry point;
  - MixLNRun: TinyTrainer over the tiny Mix-LN (or stock) GPT at one parallel layout, with
    dist_checkpointing save / load;
  - torchrun: launch a worker script under torchrun from a test or a benchmark.
Development only: no module of the package imports it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from typing import List, Optional

import torch
import torch.nn.functional as F

from mixln_megatron import cpu

# Test and benchmark workers import this harness as `harness` (from tests/): every process
# started from a process that imported it finds it on PYTHONPATH.
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)

VOCAB = 128
SEQ = 16


# ------------------------------------------------------------------ process group
def init_process_group(backend: str = "gloo") -> None:
    """A torch.distributed group: torchrun's when RANK is set, else one process on a file store."""
    if torch.distributed.is_initialized():
        return
    if "RANK" in os.environ:
        torch.distributed.init_process_group(backend=backend)
        return
    fd, path = tempfile.mkstemp(prefix="mixln_store_")
    os.close(fd)
    os.unlink(path)  # the store creates it; a stale file would hold a previous run's keys
    store = torch.distributed.FileStore(path, 1)
    torch.distributed.init_process_group(backend=backend, store=store, rank=0, world_size=1)


def init_model_parallel(tp: int = 1, pp: int = 1, vpp=None, seed: int = 1234, **kwargs) -> None:
    """megatron's parallel state (re-initialised if it exists) and its RNG trackers, seeded."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp, **kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_distributed(tp: int = 1, pp: int = 1, vpp=None, seed: int = 1234, **kwargs) -> None:
    """The CPU harness, a gloo group (one process when not under torchrun) and parallel state."""
    cpu.enable()
    init_process_group("gloo")
    init_model_parallel(tp, pp, vpp, seed=seed, **kwargs)


def shutdown() -> None:
    """Tear down parallel state and the process group (the CPU harness stays as it is)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------ the tiny LLaMA
def tiny_config(num_layers=4, hidden=64, heads=4, query_groups=None, tp=1, pp=1, vpp=None, **overrides):
    """TransformerConfig of a tiny LLaMA (fp32, CPU initialisation, fusions off); `overrides` win."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=query_groups, ffn_hidden_size=hidden * 2,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, deallocate_pipeline_outputs=True,
    )
    cfg.update(overrides)
    return TransformerConfig(**cfg)


# The same tiny LLaMA as Megatron-LM flags, for workers that go through megatron.training.
TINY_MEGATRON_LM_ARGS = (
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
    "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--normalization", "RMSNorm",
    "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--use-cpu-initialization", *cpu.CPU_MEGATRON_FLAGS,
)


def build_gpt(config, spec, vp_stage=None, pre_process=None, post_process=None, vocab=VOCAB, untie=False,
              seq=SEQ):
    """GPTModel (RoPE) for this pipeline stage; pre/post_process default to the stage's place."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
        position_embedding_type="rope", pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not untie, vp_stage=vp_stage,
    )


def build_hybrid(config, stack_spec, pattern, pre_process=None, post_process=None, vocab=VOCAB, untie=False,
                 seq=SEQ):
    """HybridModel (RoPE) with `stack_spec` and `pattern` (`|` splits the pipeline stages) for this
    pipeline stage; config.num_layers must be the pattern's length. The GPT model's twin of build_gpt."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False)
    return HybridModel(
        config=config, hybrid_stack_spec=stack_spec, vocab_size=vocab, max_sequence_length=seq,
        hybrid_layer_pattern=pattern, position_embedding_type="rope", pre_process=pre_process,
        post_process=post_process, share_embeddings_and_output_weights=not untie,
    )


def batch(seed=7, b=2, s=SEQ, vocab=VOCAB):
    """(token ids, next-token labels, positions, causal mask) of random tokens, seeded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    return ids, labels, pos, mask


# ------------------------------------------------------------------ the tiny training loop
class TinyTrainer:
    """Model chunks in megatron's DDP, its optimizer (Adam) and its pipeline schedule.

    `models`: one GPTModel per virtual stage (one without VPP). Each step runs `micro_batches`
    micro-batches of `batch(seed=...)` through get_forward_backward_func, then optimizer.step();
    the loss is the mean token loss, gathered from the last stage to every rank.
    """

    def __init__(self, config, models: List, distributed_optimizer: bool = False, lr: float = 1e-2,
                 micro_batches: int = 2, micro_batch_size: int = 2, optimizer_instances: int = 1):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = config
        self.models = models
        self.micro_batches = micro_batches
        self.micro_batch_size = micro_batch_size
        instances = {"num_distributed_optimizer_instances": optimizer_instances} if optimizer_instances > 1 else {}
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=distributed_optimizer, **instances)
        self.chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m) for m in models]
        if config.finalize_model_grads_func is None:  # hooks installed before (spike, telemetry) stay
            config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=1.0, bf16=False,
                            params_dtype=torch.float32, use_distributed_optimizer=distributed_optimizer),
            self.chunks,
        )

    def forward_backward(self, forward_only: bool, seed: int) -> float:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [batch(seed=seed + i, b=self.micro_batch_size) for i in range(self.micro_batches)]

        def forward_step(data_iterator, model):
            ids, labels, pos, mask = next(data_iterator)
            output = model(ids, pos, mask, labels=labels)

            def loss_func(output_tensor):
                loss = output_tensor.float().mean()
                return loss, {"loss": loss.detach()}

            return output, loss_func

        virtual = len(self.chunks) > 1
        iterators = [iter(batches) for _ in self.chunks]
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if virtual else iterators[0],
            model=self.chunks if virtual else self.chunks[0],
            num_microbatches=self.micro_batches, seq_length=SEQ, micro_batch_size=self.micro_batch_size,
            forward_only=forward_only,
        )
        local = float(sum(l["loss"] for l in losses) / len(losses)) if losses else None
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, local)
        return next(v for v in gathered if v is not None)

    def eval_loss(self, seed: int = 100) -> float:
        for m in self.chunks:
            m.eval()
        with torch.no_grad():
            loss = self.forward_backward(True, seed)
        for m in self.chunks:
            m.train()
        return loss

    def train(self, steps: int = 3, seed: int = 200):
        """`steps` optimizer steps -> (losses, gradient norms), one of each per step."""
        losses, grad_norms = [], []
        for step in range(steps):
            for m in self.chunks:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            losses.append(self.forward_backward(False, seed + 10 * step))
            ok, grad_norm, _ = self.optimizer.step()
            assert ok, "the optimizer skipped a step (non-finite gradients)"
            grad_norms.append(float(grad_norm))
        return losses, grad_norms


def mixln_spec(cfg, post_ln_layers, vp_stage, stock=False, scheme=None):
    """The Mix-LN decoder block spec (local backend) of this virtual stage, or the stock local one."""
    if stock:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(normalization="RMSNorm")
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    return get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=post_ln_layers,
                                        scheme=scheme, vp_stage=vp_stage)


class MixLNRun(TinyTrainer):
    """One parallel layout of the tiny Mix-LN (or stock) GPT: parallel state, model chunks (one per
    virtual stage), optionally loaded from a dist_checkpointing checkpoint, and TinyTrainer's loop.
    save / load: megatron's dist_checkpointing, with content metadata as Megatron-LM writes it."""

    def __init__(self, tp=1, pp=1, vpp=None, sp=False, distopt=False, post_ln_layers=2, stock=False,
                 load=None, seed=1234, num_layers=4, metadata_check=True, scheme=None, micro_batches=2,
                 optimizer_instances=1, **cfg_overrides):
        # optimizer_instances > 1: --num-distributed-optimizer-instances (needs the distributed optimizer)
        instances = {"num_distributed_optimizer_instances": optimizer_instances} if optimizer_instances > 1 else {}
        init_distributed(tp, pp, vpp, seed=seed, **instances)
        cfg = tiny_config(num_layers=num_layers, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, **cfg_overrides)
        self.models = [
            build_gpt(cfg, mixln_spec(cfg, post_ln_layers, i if vpp else None, stock, scheme),
                      vp_stage=i if vpp else None)
            for i in range(vpp or 1)
        ]
        if load:
            self.load(load, metadata_check)
        super().__init__(cfg, self.models, distributed_optimizer=distopt, micro_batches=micro_batches,
                         optimizer_instances=optimizer_instances)

    def sharded_state_dict(self, metadata=None):
        if len(self.models) == 1:
            return {"model": self.models[0].sharded_state_dict(metadata=metadata)}
        return {f"model{i}": m.sharded_state_dict(metadata=metadata) for i, m in enumerate(self.models)}

    def save(self, path):
        from megatron.core import dist_checkpointing

        os.makedirs(path, exist_ok=True)
        metadata = {}  # as Megatron-LM: the dict handed to sharded_state_dict is saved as content metadata
        dist_checkpointing.save(self.sharded_state_dict(metadata), path, content_metadata=metadata)

    def load(self, path, metadata_check=True):
        from megatron.core import dist_checkpointing

        metadata = dist_checkpointing.load_content_metadata(path) if metadata_check else None
        loaded = dist_checkpointing.load(self.sharded_state_dict(metadata), path)
        for key, model in zip(sorted(k for k in loaded if k.startswith("model")), self.models):
            model.load_state_dict(loaded[key])


# ------------------------------------------------------------------ TransformerEngine tests
def te_missing():
    """None when the tests marked `te` can use real TransformerEngine modules here, else why not.
    With cpu.TE_REQUIRED_ENV=1 (`make test-te` sets it once TE is laid out) a missing TE is an
    error, not a skip."""
    why = cpu.te_unavailable_reason()
    if why and os.environ.get(cpu.TE_REQUIRED_ENV) == "1":
        raise RuntimeError(f"{cpu.TE_REQUIRED_ENV}=1 requires the TE tests, but: {why}")
    return why


def te_spec(cfg, post_ln_layers, vp_stage=None, backend="te"):
    """The Mix-LN decoder block spec (TE by default) of this virtual stage."""
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    return get_mixln_decoder_block_spec(cfg, backend=backend, post_ln_layers=post_ln_layers, vp_stage=vp_stage)


def build_chunks(cfg, post_ln_layers, backend="te", vpp=None, **kwargs):
    """GPTModel chunks (one per virtual stage) of the Mix-LN spec; TE modules built on the CPU."""
    with (cpu.te_modules() if backend == "te" else contextlib.nullcontext()):
        return [build_gpt(cfg, te_spec(cfg, post_ln_layers, i if vpp else None, backend),
                          vp_stage=i if vpp else None, **kwargs) for i in range(vpp or 1)]


def chunks_sharded_state_dict(chunks, metadata=None):
    """{"model": ...} (or "model0", "model1", ... with VPP), as Megatron-LM saves model chunks."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata)}
    return {f"model{i}": m.sharded_state_dict(metadata=metadata) for i, m in enumerate(chunks)}


def save_chunks(chunks, path):
    """dist_checkpointing torch_dist save, content metadata as Megatron-LM writes it."""
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    metadata = {}
    dist_checkpointing.save(chunks_sharded_state_dict(chunks, metadata), path, content_metadata=metadata)


def load_chunks(chunks, path, ckpt_strictness=None) -> list:
    """dist_checkpointing load into the chunks; returns the keys the checkpoint lacked.

    ckpt_strictness None: megatron's default (a key the model has and the checkpoint lacks is an
    error) and a strict load_state_dict. Otherwise a dist_checkpointing StrictHandling value (as
    Megatron-LM's --dist-ckpt-strictness, e.g. "log_all"): keys the checkpoint lacks keep the
    model's values, like Megatron-LM's non-strict retry."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_content_metadata(path)
    if ckpt_strictness is None:
        loaded = dist_checkpointing.load(chunks_sharded_state_dict(chunks, metadata), path)
    else:
        loaded = dist_checkpointing.load(chunks_sharded_state_dict(chunks, metadata), path, strict=ckpt_strictness)
    missing = []
    for key, model in zip(sorted(k for k in loaded if k.startswith("model")), chunks):
        result = model.load_state_dict(loaded[key], strict=ckpt_strictness is None)
        missing += list(result.missing_keys)
    return missing


_NOT_FLAGS = {"name"}  # TE's debug name ("Layer_<n>"): a process-wide counter, not a setting


def module_flags(module) -> dict:
    """A module's own settings: its plain attributes (what TE and megatron decide at build time)."""
    import enum

    plain = (bool, int, float, str, type(None), torch.dtype, enum.Enum)
    return {k: v for k, v in vars(module).items() if isinstance(v, plain) and k not in _NOT_FLAGS}


def param_shapes(module) -> dict:
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def stock_te_spec(cfg, vp_stage=None):
    """megatron's own TE GPT decoder block spec for `cfg` (the reference for Pre-LN layers)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(cfg, use_transformer_engine=True, normalization=cfg.normalization,
                                      qk_l2_norm=cfg.qk_l2_norm, vp_stage=vp_stage)


def same_as_stock_layer(ours, theirs) -> None:
    """Assert that a Pre-LN Mix-LN layer is megatron's stock layer `theirs`: module classes and
    flags, parameter names and shapes (the layer itself is a subclass with attributes of its own)."""
    assert isinstance(ours, type(theirs)) and ours.layer_number == theirs.layer_number
    mine, ref = dict(ours.named_modules()), dict(theirs.named_modules())
    assert list(mine) == list(ref), (list(mine), list(ref))
    for name, module in ref.items():
        if name:
            assert type(mine[name]) is type(module), name
            assert module_flags(mine[name]) == module_flags(module), name
    stock_flags = module_flags(theirs)
    assert {k: module_flags(ours)[k] for k in stock_flags} == stock_flags
    assert param_shapes(ours) == param_shapes(theirs)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        for attr in ("sequence_parallel", "tensor_model_parallel", "partition_dim", "partition_stride"):
            assert getattr(a, attr, None) == getattr(b, attr, None), (name, attr)


def randomize(chunks, seed=5):
    """Every parameter drawn afresh, so that a wrong or missing load shows: norm weights
    1 + 0.3 N(0, 1) (not all ones), the rest 0.02 N(0, 1) (megatron's init scale)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                norm = "norm" in name
                p.copy_((1.0 if norm else 0.0) + (0.3 if norm else 0.02) * torch.randn(p.shape, generator=g))


def gathered_by_layer(local: dict) -> dict:
    """{global layer number: value}, sorted, from every rank's {layer number: value} of its own layers."""
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    merged = {}
    for part in parts:
        merged.update(part)
    return dict(sorted(merged.items()))


def perturb_norms(model, seed=3):
    """Norm weights moved by 0.3 N(0, 1) (a CPU generator of `seed`: the same on every rank), so that
    a checkpoint's norms are away from their init and a wrong or missing load of them shows."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------ subprocess launchers
def benchmark_parser(doc: str, quick: dict, **defaults):
    """A benchmark's parser: integer size flags with their defaults, and --quick, which
    `parse_benchmark_args` turns into the smaller sizes in `quick`."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"small sizes {quick} for a smoke run")
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    parser.set_defaults(_quick_sizes=quick)
    return parser


def parse_benchmark_args(parser, argv=None):
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in args._quick_sizes.items():
            setattr(args, name, value)
    return args


# The test session turns this on (tests/conftest.py): its python and torchrun commands then run as
# children of one fork server that imported torch and megatron-core once (dev/forked_ranks.py).
# Benchmarks and users keep fresh interpreters under the real torchrun.
FORKED_RANKS = False


def run_python(cmd, *, timeout=None, env=None, cwd=None, capture_output=True, text=True) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) for a `python ...` or torchrun command,
    forked from the preloaded server when FORKED_RANKS is on."""
    assert capture_output and text, "run_python captures text output"
    if FORKED_RANKS:
        from harness import forked_ranks

        return forked_ranks.run(cmd, timeout=timeout, env=env, cwd=cwd)
    return subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def start_python(cmd, *, env=None, cwd=None, merge_stderr=False):
    """subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE or STDOUT, text=True), forked from the
    preloaded server when FORKED_RANKS is on (pid, poll, wait, communicate, send_signal, kill)."""
    if FORKED_RANKS:
        from harness import forked_ranks

        started = forked_ranks.start(cmd, env=env, cwd=cwd, merge_stderr=merge_stderr)
        if started is not None:
            return started
    return subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True, env=env, cwd=cwd)


def torchrun(script, nproc, *args, timeout=600, env: Optional[dict] = None):
    """Run `script` under torchrun with `nproc` processes; raise with its output when it fails.

    MIXLN_* from the caller's environment is dropped: a worker sets what it measures.
    """
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    run_env.update(env or {})
    # --standalone: torchrun binds its rendezvous to a port the OS picks (no free-port race).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, *map(str, args)]
    proc = run_python(cmd, timeout=timeout, env=run_env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def single_process(script, *args, timeout=600, env: Optional[dict] = None):
    """Run `script` as one plain process (no torchrun launcher: `init_process_group` makes its
    one-rank group on a file store); raise with its output when it fails. MIXLN_* and torchrun's
    variables from the caller's environment are dropped, as `torchrun` does for MIXLN_*."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_") and k not in launcher}
    run_env.update(env or {})
    cmd = [sys.executable, script, *map(str, args)]
    proc = run_python(cmd, timeout=timeout, env=run_env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def last_result(proc) -> dict:
    """The JSON of a worker's last `RESULT {...}` line on stdout (workers print their measurements so)."""
    import json

    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


# ------------------------------------------------------------------ HybridModel twins of GPT models
def hybrid_key(gpt_key: str) -> str:
    """The HybridModel (`*-*-...` pattern) state-dict name of a GPTModel (one stage, PP1) key:
    model.checkpoint.hybrid_state_key (GPT layer i's attention half is hybrid layer 2i, its
    MLP half 2i+1; decoder.final_layernorm is decoder.final_norm)."""
    from mixln_megatron.model.checkpoint import hybrid_state_key

    return hybrid_state_key(gpt_key)


def hybrid_state_dict(gpt_model) -> dict:
    """A GPTModel's state dict under its HybridModel twin's names (load it strictly)."""
    return {hybrid_key(k): v for k, v in gpt_model.state_dict().items()}
