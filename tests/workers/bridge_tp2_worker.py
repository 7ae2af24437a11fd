"""torchrun worker (2 processes, gloo) of tests/test_bridge.py::test_tp2_and_a_checkpoint_our_tools_read.

For each exported HF folder given (made by the test, with reference.pt = {ids, logits} of the HF
model beside it): AutoBridge.from_hf_pretrained(folder, trust_remote_code=True) -> provider with
tensor_model_parallel_size = 2 (local backend, CPU harness) -> the Megatron model, sharded over the
2 ranks -> logits (gathered over TP) vs HF's, export_hf_weights vs the folder's tensors (exact), then
mixln_megatron.bridge.save_megatron_checkpoint(models, <folder>/../ckpt) (collective).
Rank 0 prints `RESULT {...}`; any mismatch raises (non-zero exit).
"""

import json
import os
import sys
import time

# torch before TE / Bridge (as in tests/test_bridge.py)
import torch

TP = 2


def gather_tp(logits):
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(TP)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def folder_tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def run_one(folder):
    import mixln_megatron.bridge as mixln_bridge
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state as ps

    t0 = time.time()
    bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = TP
    mixln_bridge.use_local_backend(provider, cpu=True)
    provider.finalize()
    models = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
    (model,) = models
    assert ps.get_tensor_model_parallel_world_size() == TP
    assert type(bridge._model_bridge).__name__ == "MixLNLlamaBridge"
    layout = (provider.post_ln_layers, provider.mixln_scheme)
    assert [layer.is_post_ln for layer in model.decoder.layers] == [
        i < provider.post_ln_layers for i in range(provider.num_layers)]

    # Really split over the 2 ranks: each holds half the query/key/value rows and half the vocabulary.
    hf_tensors = folder_tensors(folder)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    full_qkv_rows = sum(hf_tensors[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qkv")
    assert qkv.shape[0] * TP == full_qkv_rows, (qkv.shape, full_qkv_rows)
    vocab_rows = model.embedding.word_embeddings.weight.shape[0]
    assert vocab_rows * TP == hf_tensors["model.embed_tokens.weight"].shape[0]

    # Logits equal HF's (fp32, to rounding).
    ref = torch.load(os.path.join(folder, "..", "reference.pt"), weights_only=True)
    ids = ref["ids"]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, pos, None)
    if logits.shape[-1] * TP == ref["logits"].shape[-1]:
        logits = gather_tp(logits)
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=2e-5)
    max_diff = (logits - ref["logits"]).abs().max().item()

    # HF weights exported back exactly (gathered over TP on every rank).
    exported = dict(bridge.export_hf_weights(models, cpu=True, show_progress=False))
    assert set(exported) == set(hf_tensors), sorted(set(exported) ^ set(hf_tensors))
    for name, tensor in hf_tensors.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    # A Megatron-LM checkpoint of the TP2 model, for the test's convert to-hf / pretrain --load.
    ckpt = os.path.join(folder, "..", "ckpt")
    mixln_bridge.save_megatron_checkpoint(models, ckpt, tokenizer_model=folder)
    return {"layout": list(layout), "max_logit_diff": max_diff, "exported": len(exported),
            "qkv_rows_per_rank": qkv.shape[0], "vocab_rows_per_rank": vocab_rows,
            "seconds": round(time.time() - t0, 1)}


def main():
    from mixln_megatron.dev import testing

    testing.init_distributed(tp=TP)
    import mixln_megatron.bridge  # noqa: F401  (registers the bridge; after torch)

    results = {}
    for folder in sys.argv[1:]:
        results[os.path.basename(os.path.dirname(os.path.abspath(folder)))] = run_one(folder)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    testing.shutdown()


if __name__ == "__main__":  # the checkpoint writer's helper process re-imports __main__
    main()
