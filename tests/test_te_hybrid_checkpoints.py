"""torch_dist checkpoints of a HybridModel Mix-LN built from real TransformerEngine 2.20.2 modules
(one process, gloo, CPU: construction, state dicts and dist_checkpointing only; TE's forward needs
a GPU, so no logits here). Run by `make test-te`; skipped without TE.

L = 4 blocks (`*-*-*-*-`), P = 2: Post-LN blocks 1-2 have TE norms of their own (N1 in the `*`
layer, N2 in the `-` layer), Pre-LN blocks 3-4 keep TE's fused norm + linear (the norm weight is
`linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` in the TE model). Saved as
Megatron-LM saves (its parsed args in the common state, --transformer-impl transformer_engine and
the --spec object mixln_hybrid_stack_spec):
- the checkpoint's keys are the local backend's (every norm under mixln_norm_a / mixln_norm_b,
  decoder.final_norm), TE's `_extra_state` objects aside;
- it loads into the local hybrid model and into a fresh TE hybrid model: every tensor, by its
  checkpoint key, the saved TE model's;
- `convert to-hf` of it and of the local model's checkpoint of the same weights give the same
  folder: config.json equal, the safetensors files byte for byte.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys

import pytest
import torch

from mixln_megatron import compat
from mixln_megatron import cpu
from harness import testing as mu

WHY = mu.te_missing() or (None if compat.HYBRID_MODEL else "HybridModel Mix-LN needs megatron-core 0.19+")
pytestmark = [pytest.mark.te, pytest.mark.skipif(WHY is not None, reason=str(WHY))]

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "workers"))
import hybrid_ckpt_worker as C  # noqa: E402  (Megatron-LM-shaped save / load; megatron imported lazily)

L = 4
P = 2
PATTERN = "*-" * L
ITER = f"iter_{C.ITERATION:07d}"
SPEC = {"te": ("transformer_engine", "mixln_hybrid_stack_spec"), "local": ("local", "mixln_hybrid_local_stack_spec")}


def build(backend):
    from mixln_megatron.model.specs import get_mixln_hybrid_stack_spec

    cfg = mu.tiny_config(num_layers=2 * L)
    spec = get_mixln_hybrid_stack_spec(cfg, backend=backend, post_ln_layers=P, hybrid_layer_pattern=PATTERN)
    with (cpu.te_modules() if backend == "te" else contextlib.nullcontext()):
        return mu.build_hybrid(cfg, spec, PATTERN)


def megatron_lm_args(backend):
    """Megatron-LM's parsed and validated args of this model with `backend`'s --transformer-impl and
    --spec object (what its save_checkpoint writes), sys.argv restored."""
    from megatron.training.arguments import parse_args, validate_args

    impl, spec = SPEC[backend]
    argv = list(sys.argv)
    try:
        sys.argv = [argv[0], *C.MODEL_FLAGS, "--global-batch-size", "4", "--ffn-hidden-size", "128",
                    "--num-layers", str(2 * L), "--hybrid-layer-pattern", PATTERN, "--ckpt-format", "torch_dist",
                    "--transformer-impl", impl, "--spec", "mixln_megatron.spec", spec]
        args = parse_args()
        validate_args(args)
    finally:
        sys.argv = argv
    args.mixln_post_ln_layers = P  # what a patched checkout's --mixln-post-ln-layers saves
    return args


def checkpoint_weights(model) -> dict:
    """{checkpoint key: tensor} of the model's sharded state dict (TP1: whole tensors), the
    ShardedObjects (TE `_extra_state`, the settings record) left out; a factory (the gated MLP's
    linear_fc1, saved as two halves under one key) by its whole tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {v.key: v.data.detach().clone() for v in model.sharded_state_dict().values()
            if isinstance(v, (ShardedTensor, ShardedTensorFactory))}


def stored(path):
    """(tensor keys, object keys without their shard suffix) of a torch_dist checkpoint directory."""
    from mixln_megatron.convert.dcp_files import DCPFiles

    files = DCPFiles(path)
    return set(files.tensors), {k.rsplit("/shard_", 1)[0] for k in files.objects}


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def saved(mcore_single, tmp_path_factory):
    """The TE hybrid model (weights drawn afresh) saved to DIR/te, its weights by checkpoint key;
    a local hybrid model and a fresh TE hybrid model loaded from it, the local one saved to DIR/local."""
    d = str(tmp_path_factory.mktemp("te_hybrid_ckpt"))
    te = build("te")
    mu.randomize([te], seed=11)
    C.save(te, f"{d}/te", megatron_lm_args("te"))
    out = {"dir": d, "te_model": te, "want": checkpoint_weights(te)}
    torch.manual_seed(4242)  # inits unlike the saved model's
    for backend in ("local", "te"):
        model = build(backend)
        out[f"{backend}_before"] = checkpoint_weights(model)
        C.load(model, f"{d}/te")  # megatron's default strictness, strict load_state_dict
        out[f"{backend}_loaded"] = checkpoint_weights(model)
        if backend == "local":
            C.save(model, f"{d}/local", megatron_lm_args("local"))
    return out


def test_te_model_has_the_fused_te_norms(saved):
    """What makes the key test meaningful: the TE model's own names are not the local model's."""
    import transformer_engine.pytorch as te

    names = list(saved["te_model"].state_dict())
    assert "decoder.layers.4.self_attention.linear_qkv.layer_norm_weight" in names  # block 3, Pre-LN
    assert "decoder.layers.5.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.0.post_attention_layernorm.weight" in names  # block 1, Post-LN N1
    assert type(saved["te_model"].decoder.layers[0].post_attention_layernorm) is te.RMSNorm
    assert any(n.endswith("._extra_state") for n in names)


def test_te_checkpoint_keys_are_the_local_models(saved):
    d = saved["dir"]
    te_tensors, te_objects = stored(f"{d}/te/{ITER}")
    local_tensors, local_objects = stored(f"{d}/local/{ITER}")
    assert te_tensors == local_tensors == set(checkpoint_weights(build("local")))
    norms = {k for k in te_tensors if "norm" in k}
    assert norms == {f"decoder.layers.{j}.mixln_norm_{ab}.weight"
                     for block in range(L) for j, ab in ((2 * block, "b" if block < P else "a"),
                                                         (2 * block + 1, "a" if block < P else "b"))
                     } | {"decoder.final_norm.weight"}
    extra = {k for k in te_objects if k.endswith("._extra_state")}
    assert extra and any(".self_attention.linear_qkv._extra_state" in k for k in extra)
    assert te_objects - extra == {k for k in local_objects if not k.endswith("._extra_state")}
    assert "decoder.layers.0.mixln_settings" in te_objects


def test_te_checkpoint_loads_into_the_local_and_the_te_hybrid_model(saved):
    want = saved["want"]
    assert len(want) > 20 and sum(t.numel() for t in want.values()) > 50_000
    for backend in ("local", "te"):
        before, loaded = saved[f"{backend}_before"], saved[f"{backend}_loaded"]
        assert any(not torch.equal(before[k], want[k]) for k in want), backend  # the load did something
        assert_same(loaded, want)


def test_to_hf_of_the_te_checkpoint_is_the_local_checkpoints_export(saved, tmp_path):
    pytest.importorskip("transformers")
    from mixln_megatron.convert.cli import main

    d = saved["dir"]
    for name in ("te", "local"):
        assert main(["to-hf", "--load", f"{d}/{name}", "--save", str(tmp_path / name), "--no-progress"]) == 0
    config = [json.load(open(tmp_path / name / "config.json")) for name in ("te", "local")]
    assert config[0] == config[1]
    assert config[0]["num_hidden_layers"] == L
    files = [sorted(glob.glob(str(tmp_path / name / "*.safetensors"))) for name in ("te", "local")]
    assert files[0] and [os.path.basename(f) for f in files[0]] == [os.path.basename(f) for f in files[1]]
    for a, b in zip(*files):
        assert open(a, "rb").read() == open(b, "rb").read()
