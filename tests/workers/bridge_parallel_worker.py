"""torchrun worker (2 processes, gloo) of tests/test_bridge.py's parallel tests.

    bridge_parallel_worker.py --tp N --pp M [--vpp V] [--refuse-without NAME] FOLDER [FOLDER ...]
                                                                     (N * M = the world size)

For each exported HF folder given (made by the test, with reference.pt = {ids, logits} of the HF
model beside it): AutoBridge.from_hf_pretrained(folder, trust_remote_code=True) -> provider with
these TP / PP / virtual-pipeline sizes (local backend, CPU harness) -> the Megatron model chunks,
split over the ranks -> every layer of the whole job, once, of the kind of its global number ->
logits through megatron's own pipeline schedule (forward only; interleaved with virtual stages)
vs HF's, gathered over TP -> export_hf_weights vs the folder's tensors (exact), then
mixln_megatron.bridge.save_megatron_checkpoint(models, <folder>/../ckpt) (collective). With
--refuse-without NAME, the first folder is then loaded once more with NAME's mapping taken out of
the registry: every rank must refuse it (ConversionError), its line is the result's "refusal".
Rank 0 prints `RESULT {...}`; any mismatch raises (non-zero exit).
"""

import argparse
import json
import os
import time

# torch before TE / Bridge (as in tests/test_bridge.py)
import torch


def gather_tp(logits, tp):
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def folder_tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def schedule_logits(models, ids, pos):
    """The logits of `ids` through megatron's pipeline schedule, forward only (interleaved over
    the chunks of virtual stages): this rank's vocabulary part on the last stage, None elsewhere.
    The interleaved schedule takes micro-batches in multiples of the pipeline size: the batch is
    fed that many times, and the first one's logits are returned."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seen = []

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(ids, pos, None)

        def loss_func(logits):
            seen.append(logits.detach())
            return logits.float().mean(), {}

        return output, loss_func

    microbatches = ps.get_pipeline_model_parallel_world_size()
    iterators = [iter([None] * microbatches) for _ in models]
    virtual = len(models) > 1
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if virtual else iterators[0],
            model=models if virtual else models[0], num_microbatches=microbatches, seq_length=ids.shape[1],
            micro_batch_size=ids.shape[0], forward_only=True)
    return seen[0] if seen else None


def build_models(folder, tp, pp, vpp):
    """AutoBridge -> provider at these sizes (local backend, CPU) -> (bridge, provider, model chunks)."""
    import mixln_megatron.bridge as mixln_bridge
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.virtual_pipeline_model_parallel_size = vpp
    mixln_bridge.use_local_backend(provider, cpu=True)
    provider.finalize()
    models = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
    return bridge, provider, models


def refusal_without(folder, tp, pp, vpp, megatron_param):
    """The error line of a load whose registry lacks `megatron_param`'s mapping (a parameter only
    some ranks hold): every rank must raise it, so none is left waiting for the others."""
    import mixln_megatron.bridge as mixln_bridge
    from mixln_megatron.errors import ConversionError, one_line

    real = mixln_bridge.MixLNLlamaBridge.mapping_registry

    def without_it(self):
        registry = real(self)
        kept = [m for m in registry.mappings if m.megatron_param != megatron_param]
        assert len(kept) == len(registry.mappings) - 1, megatron_param
        return type(registry)(*kept)

    mixln_bridge.MixLNLlamaBridge.mapping_registry = without_it
    try:
        build_models(folder, tp, pp, vpp)
    except ConversionError as error:
        return one_line(error)
    finally:
        mixln_bridge.MixLNLlamaBridge.mapping_registry = real
    raise AssertionError(f"rank {torch.distributed.get_rank()}: loaded without a mapping for {megatron_param}")


def run_one(folder, tp, pp, vpp):
    import mixln_megatron.bridge as mixln_bridge
    from megatron.core import parallel_state as ps

    t0 = time.time()
    bridge, provider, models = build_models(folder, tp, pp, vpp)
    assert len(models) == (vpp or 1)
    assert ps.get_tensor_model_parallel_world_size() == tp and ps.get_pipeline_model_parallel_world_size() == pp
    assert type(bridge._model_bridge).__name__ == "MixLNLlamaBridge"
    layout = (provider.post_ln_layers, provider.mixln_scheme)

    # Every layer of the job, by its global number (1-based), is built once, on one stage, of the
    # kind the HF config gives that number (layer_kinds, or Post-LN exactly below P): [chunk][layer
    # numbers] of this rank, then of all ranks.
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    kinds = config.get("layer_kinds") or [
        "post" if n < config["post_ln_layers"] else "pre" for n in range(config["num_hidden_layers"])]
    numbers = [[layer.layer_number for layer in m.decoder.layers] for m in models]
    for m in models:
        assert [l.kind for l in m.decoder.layers] == [kinds[l.layer_number - 1] for l in m.decoder.layers]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, numbers if ps.get_tensor_model_parallel_rank() == 0 else [])
    built = sorted(n for chunks in everyone for chunk in chunks for n in chunk)
    assert built == list(range(1, provider.num_layers + 1)), everyone

    # Really split: under TP each rank holds half the query/key/value rows and half the vocabulary.
    model = models[0]
    hf_tensors = folder_tensors(folder)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    full_qkv_rows = sum(hf_tensors[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qkv")
    assert qkv.shape[0] * tp == full_qkv_rows, (qkv.shape, full_qkv_rows)

    # Logits equal HF's (fp32, to rounding), on the last stage.
    ref = torch.load(os.path.join(folder, "..", "reference.pt"), weights_only=True)
    ids = ref["ids"]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    logits = schedule_logits(models, ids, pos)
    max_diff = None
    if logits is not None:
        if logits.shape[-1] * tp == ref["logits"].shape[-1] and tp > 1:
            logits = gather_tp(logits, tp)
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=2e-5)
        max_diff = (logits - ref["logits"]).abs().max().item()
    box = [max_diff]  # the last stage's figure, for rank 0's line
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_world_size() - 1)

    # HF weights exported back exactly (gathered over TP and PP on every rank).
    exported = dict(bridge.export_hf_weights(models, cpu=True, show_progress=False))
    assert set(exported) == set(hf_tensors), sorted(set(exported) ^ set(hf_tensors))
    for name, tensor in hf_tensors.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    # A Megatron-LM checkpoint of the split model, for the test's convert to-hf / pretrain --load.
    ckpt = os.path.join(folder, "..", "ckpt")
    mixln_bridge.save_megatron_checkpoint(models, ckpt, tokenizer_model=folder)
    return {"layout": list(layout), "max_logit_diff": box[0], "exported": len(exported),
            "qkv_rows_per_rank": qkv.shape[0], "layer_numbers": everyone,
            "seconds": round(time.time() - t0, 1)}


def main():
    from harness import testing

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--refuse-without", default=None,
                        help="then load the first folder without this Megatron parameter's mapping: refused on every rank")
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args()
    testing.init_distributed(tp=args.tp, pp=args.pp, vpp=args.vpp)
    import mixln_megatron.bridge  # noqa: F401  (registers the bridge; after torch)

    results = {}
    for folder in args.folders:
        results[os.path.basename(os.path.dirname(os.path.abspath(folder)))] = run_one(folder, args.tp, args.pp, args.vpp)
    if args.refuse_without:
        results["refusal"] = refusal_without(args.folders[0], args.tp, args.pp, args.vpp, args.refuse_without)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    testing.shutdown()


if __name__ == "__main__":  # the checkpoint writer's helper process re-imports __main__
    main()
