"""Mix-LN vs Pre-LN forward+backward step time on CPU (local backend), same shape, one process.

Mix-LN moves norms; it adds no FLOPs, so the physical limit of the ratio is 1.00 (target <= 1.03).
Variants are timed interleaved (A B C A B C ...) so that machine noise hits all alike; medians
are compared. Pre-LN is the Mix-LN spec with P = 0 (same norm implementation); megatron's stock
local spec (torch.nn.RMSNorm) is timed too, for reference.

    python benchmarks/overhead.py [--quick] [--layers 8 --hidden 256 --seq 256 --batch 4 --steps 30]
Last line: RESULT mixln_over_preln=<ratio> steps=<n>
"""

import repo_paths  # noqa: F401  (tests/ and scripts/ on sys.path: the harness, the plots)
import os
import statistics
import time

import torch

from harness import testing


def build(kind, cfg, post_ln_layers):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mixln_megatron.spec import get_mixln_decoder_block_spec

    torch.manual_seed(0)
    if kind == "stock":
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    else:
        spec = get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=post_ln_layers)
    return testing.build_gpt(cfg, spec, vocab=1024)


def main(argv=None):
    parser = testing.benchmark_parser(
        __doc__, quick=dict(layers=4, hidden=128, seq=128, batch=2, steps=12),
        layers=8, hidden=256, seq=256, batch=4, steps=30, alpha=0.25,
    )
    a = testing.parse_benchmark_args(parser, argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    testing.init_distributed()
    from mixln_megatron.model.placement import post_ln_count

    post = post_ln_count(a.alpha, a.layers)
    cfg = testing.tiny_config(num_layers=a.layers, hidden=a.hidden, heads=max(1, a.hidden // 32))
    models = {
        "preln": build("mixln", cfg, 0),
        "mixln": build("mixln", cfg, post),
        "stock_preln": build("stock", cfg, 0),
    }
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (a.batch, a.seq), generator=g)
    labels = torch.roll(ids, -1, 1)
    pos = torch.arange(a.seq).unsqueeze(0).expand(a.batch, a.seq)
    mask = torch.triu(torch.ones(1, 1, a.seq, a.seq, dtype=torch.bool), 1)

    def step(model):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(ids, pos, mask, labels=labels).mean().backward()
        return time.perf_counter() - t0

    for model in models.values():  # warm-up
        for _ in range(2):
            step(model)
    times = {k: [] for k in models}
    for _ in range(a.steps):
        for name, model in models.items():
            times[name].append(step(model))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"shape: L={a.layers} P={post} h={a.hidden} seq={a.seq} batch={a.batch} threads={torch.get_num_threads()}")
    for k, v in med.items():
        spread = statistics.quantiles(times[k], n=4) if len(times[k]) >= 4 else [v, v, v]
        print(f"  {k:12s} median {v * 1e3:8.2f} ms   (quartiles {spread[0] * 1e3:.2f} .. {spread[2] * 1e3:.2f})")
    print(f"  stock_preln / preln (norm implementation only): {med['stock_preln'] / med['preln']:.4f}")
    ratio = med["mixln"] / med["preln"]
    print(f"RESULT mixln_over_preln={ratio:.4f} steps={a.steps}")
    torch.distributed.destroy_process_group()
    return ratio


if __name__ == "__main__":
    main()
