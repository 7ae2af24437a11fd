"""`mixln-megatron analyze ...`: the diagnostics of the Mix-LN paper on our models.

  grad-norms         per-layer gradient norm at initialization of Pre-LN, Post-LN and Mix-LN
                     megatron-core GPTs of one shape, on real text batches (Figures 3e / 6a)
  angular-distance   mean angular distance between the inputs of layers l and l + n (Eq. 8,
                     Figure 5) of a Megatron torch_dist checkpoint or a Hugging Face folder
  layer-drop         perplexity increase when each single layer is bypassed (Eq. 9, perplexity
                     in place of accuracy), same model sources
  train-health       plots of the per-layer telemetry a training run logged (analysis.train_health)

Each writes <out-dir>/<name>.json and <out-dir>/<name>.png and prints a short table (docs/commands.md).
The tokenizer: --tokenizer-model DIR, else the HF folder's own, else the one named in the Megatron
checkpoint's args if that directory exists here, else the shipped byte-level BPE. A refusal (a bad
input or option) is one stderr line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch

from .. import cpu
from ..cli_parsing import CommandParser, add_flag, refused
from ..convert.megatron_reader import announce_checkpoint_read
from ..data.tokenizer import TokenizerSpec, load_tokenizer
from ..errors import MixLNError
from ..known_warnings import quiet_known_warnings
from . import diagnostics, loading, models
from .diagnostics import DEFAULT_VARIANTS, VARIANTS


def _seeds(text: str):
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, got {text!r}") from None


def _variants(text: str):
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    return names


def _embedding_std(text: str):
    if text in ("megatron", "default"):
        return None
    if text == "reference":
        return models.REFERENCE_EMBEDDING_STD
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("--embedding-std takes a number, 'megatron' or 'reference'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("--embedding-std must be positive")
    return value


def _add_text_args(p):
    p.add_argument("--text", default=None, help="text file (default: the shipped Austen corpus)")
    add_flag(p, "--tokenizer-model", "--tokenizer", default=None,
             help="Hugging Face tokenizer directory (default: the model's own, else the shipped one)")
    p.add_argument("--cache-dir", default=None, help="where the shipped corpus is tokenized once (default: $TMPDIR)")
    p.add_argument("--out-dir", default="analysis", help="where the JSON and PNG go (default: ./analysis)")


def _add_model_source_args(p):
    src = p.add_mutually_exclusive_group(required=True)
    add_flag(src, "--load", "--megatron", metavar="DIR",
             help="Megatron-LM torch_dist checkpoint: the --save directory or one iter_* directory")
    src.add_argument("--hf", metavar="DIR", help="Hugging Face folder (LLaMA or our mixln_llama export)")
    add_flag(p, "--ckpt-step", "--iteration", dest="iteration", type=int, default=None, metavar="N",
             help="Megatron checkpoint step (default: latest)")
    add_flag(p, "--mixln-post-ln-layers", "--post-ln-layers", type=int, default=None,
             help="override P for a Megatron checkpoint (default: the checkpoint's record)")
    add_flag(p, "--mixln-scheme", "--scheme", default=None, choices=("mixln", "lns", "mixln+lns"),
             help="override the scheme for a Megatron checkpoint")
    p.add_argument("--tokens", type=int, default=8192, help="tokens to average over (default 8192)")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = CommandParser(prog=prog or "mixln-megatron analyze", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("grad-norms", help="per-layer gradient norms at initialization (Figures 3e / 6a)",
                       description="Per-layer gradient norm (L2 over each layer's parameters) at "
                       "initialization, one fresh megatron-core GPT per variant and seed.")
    g.add_argument("--num-layers", type=int, default=12, help="transformer layers L (default 12)")
    g.add_argument("--hidden-size", type=int, default=128, help="hidden size (default 128)")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads (default 4)")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 8/3 hidden, rounded up to 16")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sequence (default 128)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    g.add_argument("--num-batches", type=int, default=4, help="batches whose mean loss is differentiated")
    add_flag(g, "--mixln-alpha", "--alpha", type=float, default=0.25,
             help="Mix-LN alpha (P = floor(alpha * L)); default 0.25")
    g.add_argument("--variants", type=_variants, default=list(DEFAULT_VARIANTS),
                   help=f"comma list from {', '.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    g.add_argument("--seeds", type=_seeds, default=[1234, 1235, 1236], help="model init seeds (default 3)")
    g.add_argument("--data-seed", type=int, default=0, help="which windows of the text are used")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Megatron's weight init std (default 0.02)")
    g.add_argument("--exclude-norms", action="store_true",
                   help="norm over the weight matrices only (default: every parameter of the layer, "
                   "the norms' scale vectors included)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="MoE layers of this many experts (megatron's router and local experts; default dense)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token of the MoE layers (default 2)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's FFN width (default: the dense FFN width over top-k)")
    g.add_argument("--embedding-std", type=_embedding_std, default=None,
                   help="embedding init std: a number, 'megatron' (= init-method-std, default) or "
                   "'reference' (sqrt(2/5), the Mix-LN reference code)")
    _add_text_args(g)

    a = sub.add_parser("angular-distance", help="angular distance between layer inputs (Eq. 8, Figure 5)")
    _add_model_source_args(a)
    _add_text_args(a)

    d = sub.add_parser("layer-drop", help="perplexity increase per bypassed layer (Eq. 9)")
    _add_model_source_args(d)
    _add_text_args(d)

    # Its own parser (analysis.train_health) takes the arguments; imported only when it runs.
    sub.add_parser("train-health", add_help=False,
                   help="plots of the per-layer telemetry a training run logged (RUN_DIR [--out-dir DIR])")
    return parser


def _tokenizer_spec(a, lm=None):
    if a.tokenizer_model:
        return TokenizerSpec.hf_dir(a.tokenizer_model)
    hf = getattr(a, "hf", None)
    if hf and any(os.path.exists(os.path.join(hf, f)) for f in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        return TokenizerSpec.hf_dir(hf)
    args = getattr(lm, "saved_args", None)
    model_dir = getattr(args, "tokenizer_model", None) if args is not None else None
    if model_dir and os.path.isdir(model_dir):
        return TokenizerSpec.hf_dir(model_dir)
    return None  # the shipped tokenizer


def _write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def _run_grad_norms(a) -> int:
    spec = _tokenizer_spec(a)
    tokens = models.corpus_tokens(a.text, spec, a.cache_dir)
    vocab = int(math.ceil(load_tokenizer(spec).vocab_size / 128) * 128)  # Megatron-style padding
    shape = models.FreshShape(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, vocab_size=vocab, seq_length=a.seq_length,
        init_method_std=a.init_method_std, embedding_init_std=a.embedding_std,
    )
    batch_list = models.batches(tokens, a.seq_length, a.batch_size, a.num_batches, seed=a.data_seed)
    moe = {}
    if a.num_experts:
        expert_ffn = a.moe_ffn_hidden_size or max(1, shape.ffn // a.moe_router_topk)  # active width = dense
        moe = loading.fresh_moe_fields(a.num_experts, a.moe_router_topk, expert_ffn)
    t0 = time.time()
    result = diagnostics.measure_at_init(shape, batch_list, a.variants, a.mixln_alpha, a.seeds, a.exclude_norms,
                                        config_overrides=moe)
    if moe:
        result["moe"] = {"num_experts": a.num_experts, "moe_router_topk": a.moe_router_topk,
                         "moe_ffn_hidden_size": moe["moe_ffn_hidden_size"]}
    result.update(
        when="at initialization", text=a.text or "shipped Austen corpus",
        tokens_per_gradient=a.batch_size * a.num_batches * a.seq_length, seconds=round(time.time() - t0, 1),
        checks=diagnostics.qualitative_checks(result),
    )
    base = os.path.join(a.out_dir, "grad_norms")
    _write_json(base + ".json", result)
    diagnostics.plot_profiles(result, base + ".png",
                             title=f"per-layer gradient norm at initialization\n{shape.describe()}")
    where = f", MoE {a.num_experts} experts top-{a.moe_router_topk}" if moe else ""
    print(f"per-layer gradient norms at initialization: {shape.describe()}{where}, {len(a.seeds)} seed(s), "
          f"{result['tokens_per_gradient']} tokens")
    print(diagnostics.format_table(result))
    for name, ok in result["checks"].items():
        print(f"  {name}: {ok}")
    print(f"wrote {base}.json and {base}.png")
    return 0


def _load(a):
    if a.load:
        return loading.load_megatron_checkpoint(a.load, iteration=a.iteration, post_ln_layers=a.mixln_post_ln_layers,
                                                scheme=a.mixln_scheme)
    if a.mixln_post_ln_layers is not None or a.mixln_scheme is not None:
        raise ValueError("--mixln-post-ln-layers / --mixln-scheme apply to Megatron checkpoints; an HF folder's "
                         "config says them")
    return loading.load_hf_model(a.hf)


def _eval_batches(a, lm):
    spec = _tokenizer_spec(a, lm)
    tokens = models.corpus_tokens(a.text, spec, a.cache_dir)
    seq = a.seq_length
    max_pos = getattr(getattr(lm.module, "config", None), "max_position_embeddings", None)
    if lm.kind == "megatron":
        max_pos = getattr(lm.module, "max_sequence_length", None)
    if max_pos and seq > max_pos:
        seq = int(max_pos)
    out = models.eval_batches(tokens, a.tokens, seq, a.batch_size)
    models.check_vocab(out, lm.vocab_size)
    return out, seq


def _measure_checkpoint(a, compute, name):
    """Load the model, build the text batches, run `compute(lm, batches)`, write <name>.json."""
    lm = _load(a)
    batch_list, seq = _eval_batches(a, lm)
    t0 = time.time()
    result = compute(lm, batch_list)
    result.update(model=lm.describe(), text=a.text or "shipped Austen corpus", seq_length=seq,
                  seconds=round(time.time() - t0, 1))
    base = os.path.join(a.out_dir, name)
    _write_json(base + ".json", result)
    return lm, result, base


def _run_angular(a) -> int:
    lm, result, base = _measure_checkpoint(a, diagnostics.angular_distance_matrix, "angular_distance")
    diagnostics.plot_heatmap(result, base + ".png", title=f"angular distance, {lm.describe()[:90]}")
    print(lm.describe())
    print(f"angular distance over {result['tokens']} tokens; d(x_l, x_l+1) per layer:")
    print("  " + " ".join(f"{x:.3f}" for x in result["adjacent"]))
    print(f"wrote {base}.json and {base}.png")
    return 0


def _run_layer_drop(a) -> int:
    lm, result, base = _measure_checkpoint(a, diagnostics.layer_drop, "layer_drop")
    diagnostics.plot_layer_drop(result, base + ".png")
    print(lm.describe())
    b = result["baseline"]
    print(f"baseline perplexity {b['ppl']:.3f} over {b['tokens']} tokens")
    print(f"{'layer':>5} {'PPL without':>12} {'delta':>10}")
    for r in result["layers"]:
        print(f"{r['layer']:>5} {r['ppl']:>12.3f} {r['delta_ppl']:>10.3f}")
    print(f"wrote {base}.json and {base}.png")
    return 0


def _megatron_on_this_machine():
    """The command owns its process: without CUDA it enters the CPU harness for the analyses."""
    return contextlib.nullcontext() if torch.cuda.is_available() else cpu.harness()


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    quiet_known_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or "mixln-megatron analyze"
    where = f"{prog} {argv[0]}" if argv and not argv[0].startswith("-") else prog  # the refusal line's command
    try:
        if argv[:1] == ["train-health"]:  # analysis.train_health parses its own arguments
            from . import train_health  # heavy: megatron, through the telemetry's file name

            return train_health.main(argv[1:], prog=where)
        a = build_parser(prog).parse_args(argv)
        if getattr(a, "load", None):
            announce_checkpoint_read(a.load, a.iteration)  # a large .metadata: say so before reading it
            loading.inspect_for_analysis(a.load, a.iteration)  # refuse a bad checkpoint before megatron is imported
        if getattr(a, "hf", None):
            loading.check_hf_folder(a.hf)  # refuse a bad folder (confined, validated) before the harness or transformers
        if a.command == "grad-norms" and (a.num_layers < 1 or a.batch_size < 1 or a.num_batches < 1 or not a.seeds):
            raise ValueError("--num-layers, --batch-size, --num-batches must be positive and --seeds non-empty")
        if a.command == "grad-norms" and a.num_experts is not None and not 1 <= a.moe_router_topk <= a.num_experts:
            raise ValueError(f"--moe-router-topk must be between 1 and --num-experts ({a.num_experts})")
        run = {"grad-norms": _run_grad_norms, "angular-distance": _run_angular}.get(a.command, _run_layer_drop)
        with _megatron_on_this_machine():
            return run(a)
    except (MixLNError, ValueError, OSError) as e:  # a refused input or setting, or an unreadable file
        return refused(where, e)


if __name__ == "__main__":
    sys.exit(main(prog="python -m mixln_megatron.analysis.cli"))
