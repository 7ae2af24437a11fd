"""`mixln-megatron convert to-hf | from-hf | gpt-to-hybrid | hybrid-to-gpt | inspect [--check]`: the
command line of mixln_megatron.convert (`--help` for each sub-command's flags).

Exit status (docs/commands.md): 0 on success, 2 when refused or failed or for a usage error (one
stderr line says why; no output is left behind), 1 on an unexpected error, 128 + N when stopped by
signal N (the temporary output is removed and the previous output, if any, is kept).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Optional, Sequence

from ..cli_parsing import CommandParser, add_flag, refused
from ..errors import MixLNError
from ..known_warnings import quiet_known_warnings
from ..safe_output import Interrupted, signals_as_interrupt


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mixln-megatron convert",
        description="Convert checkpoints between Megatron-LM (torch_dist or legacy torch) and Hugging Face.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{to-hf,from-hf,gpt-to-hybrid,hybrid-to-gpt,inspect}")
    sub.required = True

    to = _direction(
        sub, "to-hf", "Megatron-LM checkpoint -> Hugging Face folder",
        "Export a Megatron-LM checkpoint (GPTModel, dense or MoE, or a dense HybridModel; any TP/PP/VPP/EP, "
        "torch_dist or legacy torch format) as a Hugging Face folder: config.json, safetensors shards + index, "
        "generation_config.json. The class is a stock one (LlamaForCausalLM, MixtralForCausalLM, "
        "Qwen2MoeForCausalLM) only where it is the same network, else the Mix-LN class with its code files and "
        "auto_map (load with trust_remote_code=True). The model shape and the Mix-LN settings are read from the "
        "checkpoint.",
        load="Megatron-LM --save directory (or one iter_*/release dir in it)",
        save="output Hugging Face folder (must not exist or be empty)",
        dtype="dtype of the exported weights (auto: the checkpoint's)",
    )
    add_flag(to, "--ckpt-step", "--iteration", dest="iteration", default=None, metavar="N",
             help="checkpoint step to export (default: latest_checkpointed_iteration.txt); 'release' allowed")
    add_flag(to, "--tokenizer-model", "--tokenizer", default=None, metavar="DIR",
             help="tokenizer directory to copy into the output (also gives the true vocabulary size and "
                    "the special token ids)")
    to.add_argument("--vocab-size", type=int, default=None,
                    help="true (unpadded) vocabulary size, when the checkpoint's args do not record it")
    to.add_argument("--max-shard-size", default="5GB", type=_shard_size,
                    help="largest safetensors shard (default 5GB; also MB, GiB, MiB or bytes)")

    fr = _direction(
        sub, "from-hf", "Hugging Face folder -> Megatron-LM checkpoint",
        "Write a Megatron-LM checkpoint (iteration 'release': loaded as iteration 0, no optimizer "
        "state) from a Hugging Face folder: a Mix-LN export (dense or MoE), a stock Llama, Mixtral or Qwen2-MoE. "
        "torch_dist (default) is layout-free: it loads "
        "at any TP/PP/VPP whose padded vocabulary matches; --tp sets that padding (make-vocab-size-divisible-by "
        "x TP) and is recorded in the args. The legacy torch format (dense models) is written for exactly --tp x --pp "
        "ranks.",
        load="Hugging Face folder (config.json + safetensors or .bin)",
        save="output Megatron-LM checkpoint directory (for --load)",
        dtype="dtype of the written weights (auto: the folder's)",
    )
    fr.add_argument("--tp", type=int, default=1, help="tensor-parallel size the checkpoint is written for")
    fr.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the checkpoint is written for")
    fr.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                    help="torch_dist (default, layout-free) or torch (legacy per-rank files)")
    fr.add_argument("--transformer-impl", default="transformer_engine", choices=["transformer_engine", "local"],
                    help="module names of legacy files and the --spec recorded in the args (torch_dist keys are "
                    "the same for both)")
    fr.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                    help="Megatron's vocabulary padding unit (default 128; padded to a multiple of it x TP)")
    group = fr.add_mutually_exclusive_group()
    add_flag(group, "--mixln-post-ln-layers", "--post-ln-layers", type=int, default=None,
             help="stock Llama folders only: convert as Mix-LN with P Post-LN layers (default: Pre-LN, "
             "P = 0). A Mix-LN folder's own settings are always kept.")
    group.add_argument("--mixln-alpha", default=None, help="like --mixln-post-ln-layers, as P = floor(alpha * L)")
    fr.add_argument("--mixln-scheme", default=None, choices=["mixln", "lns", "mixln+lns"],
                    help="stock Llama folders only: the scheme to convert as")
    fr.add_argument("--tokenizer-model", default=None,
                    help="tokenizer path recorded in the args (default: the HF folder when it has tokenizer files)")
    for name, src, dst in (("gpt-to-hybrid", "GPTModel", "HybridModel"), ("hybrid-to-gpt", "HybridModel", "GPTModel")):
        kind = sub.add_parser(
            name, help=f"{src} Mix-LN checkpoint -> {dst} checkpoint of the same network",
            description=f"Rewrite a {src} Mix-LN torch_dist checkpoint (any TP/PP) as the {dst} checkpoint of the "
            "same network (HybridModel pattern '*-' x L), keeping every Mix-LN norm, the settings record and the "
            "spike-scaler state, with Megatron-LM's args adjusted (num_layers, hybrid_layer_pattern, --spec). "
            "Model weights only: optimizer and RNG state are NOT converted, so resume with --no-load-optim "
            "--no-load-rng (or --finetune). Hybrid patterns other than '*-' pairs (Mamba, MoE, MLA, MTP) are refused.")
        kind.add_argument("--load", required=True, help="Megatron-LM --save directory (or one iter_*/release dir in it)")
        kind.add_argument("--save", required=True,
                          help="output Megatron-LM checkpoint directory (must not exist or be empty)")
        add_flag(kind, "--ckpt-step", "--iteration", dest="iteration", default=None, metavar="N",
                 help="checkpoint step to convert (default: the latest)")
        kind.add_argument("--overwrite", action="store_true", help="replace a non-empty --save directory")
        kind.add_argument("--no-progress", action="store_true", help="no progress bar")
    show = sub.add_parser("inspect", help="describe a Megatron-LM checkpoint",
                          description="What a checkpoint holds: format, model kind (GPTModel / HybridModel and "
                          "its pattern), transformer blocks, the Mix-LN settings and where they come from, the shape.")
    show.add_argument("--load", required=True, help="Megatron-LM --save directory (or one iter_*/release dir in it)")
    add_flag(show, "--ckpt-step", "--iteration", dest="iteration", default=None, metavar="N",
             help="checkpoint step to inspect (default: the latest)")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.add_argument("--check", action="store_true",
                      help="vet the checkpoint before a stock Megatron-LM --load: read every pickle the load would "
                      "read (.metadata, common.pt, every .distcp byte item incl. RNG / optimizer state and TE "
                      "extra state, legacy mp_rank_* files) through the allow-list; exit 0 and one line if it is "
                      "clean, the refusal line and exit 2 if not")
    return parser


def _shard_size(text: str) -> str:
    """--max-shard-size, checked as it is parsed: a usage error, not a traceback at the write."""
    from .to_hf import parse_size  # heavy: torch, imported when the flag is parsed

    try:
        if parse_size(text) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB or a number of bytes)")


def _direction(sub, name: str, summary: str, description: str, *, load: str, save: str, dtype: str):
    """A sub-command with the options both directions share (their help says which side is which)."""
    p = sub.add_parser(name, help=summary, description=description)
    p.add_argument("--load", required=True, help=load)
    p.add_argument("--save", required=True, help=save)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help=dtype)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --save directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_known_warnings()  # reading a Megatron-LM checkpoint's args imports megatron-core
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from .megatron_reader import announce_checkpoint_read  # heavy: torch, after the warnings are silenced
    try:
        with signals_as_interrupt():
            if args.command != "from-hf":  # it reads a Megatron-LM checkpoint: say so first when it is large
                announce_checkpoint_read(args.load, args.iteration, every_pickle=args.command == "inspect" and args.check)
            return _run(args)
    except (MixLNError, OSError) as e:  # a refused input, or one the system will not let us read or write
        return refused(f"mixln-megatron convert {args.command}", e)
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        where = f"; {args.save} is as it was before this run" if getattr(args, "save", None) else ""
        print(f"mixln-megatron convert {args.command}: stopped by {signal.Signals(signum).name}: the temporary "
              f"output was removed{where}", file=sys.stderr)
        return 128 + signum


def _run(args) -> int:
    """Run one sub-command; refusals raise MixLNError (mostly ConversionError)."""
    if args.command in ("gpt-to-hybrid", "hybrid-to-gpt"):
        from .gpt_hybrid import convert_gpt_to_hybrid, convert_hybrid_to_gpt  # heavy: torch, imported when the command runs

        run = convert_gpt_to_hybrid if args.command == "gpt-to-hybrid" else convert_hybrid_to_gpt
        summary = run(args.load, args.save, iteration=args.iteration, overwrite=args.overwrite,
                      progress=not args.no_progress)
        print(f"[mixln-megatron convert] {json.dumps(summary)}")
        entry = "pretrain_hybrid.py" if summary["target_kind"] == "HybridModel" else "pretrain_gpt.py"
        print(f"[mixln-megatron convert] {summary['source_kind']} -> {summary['target_kind']}: {summary['blocks']} "
              f"blocks, scheme={summary['scheme']} "
              + (f"layout={summary['layout']}" if summary["layout"] else f"P={summary['post_ln_layers']}")
              + "; model weights only (optimizer and "
              f"RNG state are not converted): resume with {entry} --load {summary['save']} --no-load-optim "
              "--no-load-rng (or --finetune)"
              + (f" --hybrid-layer-pattern '{summary['hybrid_pattern']}'" if entry == "pretrain_hybrid.py" else ""))
        return 0
    if args.command == "inspect" and args.check:
        from .vet import vet_checkpoint  # heavy: torch, imported when the command runs

        report = vet_checkpoint(args.load, args.iteration)
        if args.json:
            print(json.dumps({"checkpoint": report.path, "format": report.format, "clean": True,
                              "pickles": report.pickles, "seconds": round(report.seconds, 3)}))
        else:
            print(f"[mixln-megatron convert] {report.line()}")
        return 0
    if args.command == "inspect":
        from .inspect import describe_checkpoint  # heavy: torch, imported when the command runs

        info = describe_checkpoint(args.load, args.iteration)
        if args.json:
            print(json.dumps(info))
        else:
            for key, value in info.items():
                print(f"{key}: {value}")
        return 0
    if args.command == "to-hf":
        from .to_hf import convert_to_hf  # heavy: torch, imported when the command runs

        summary = convert_to_hf(
            args.load, args.save, iteration=args.iteration, dtype=args.dtype, tokenizer=args.tokenizer_model,
            vocab_size=args.vocab_size, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
            progress=not args.no_progress,
        )
        print(
            f"[mixln-megatron convert] {summary['format']} checkpoint {summary['checkpoint']} "
            f"(iteration {summary['iteration']}) -> {summary['save']}: {summary['architecture']}, "
            f"scheme={summary['scheme']} "
            + (f"layout={summary['layout']}" if summary["layout"] else f"P={summary['post_ln_layers']}")
            + f" ({summary['settings_source']}), "
            f"vocab {summary['vocab_size']} of {summary['padded_vocab_size']} rows ({summary['vocab_source']}), "
            f"{summary['dtype']}, {summary['bytes'] / 2**20:.1f} MiB in {summary['seconds']} s"
        )
        if summary["remote_code"]:
            print("[mixln-megatron convert] load with AutoModelForCausalLM.from_pretrained(dir, "
                  "trust_remote_code=True); serve with vLLM / SGLang through their Transformers backend "
                  "(--model-impl transformers --trust-remote-code)")
    else:
        from .from_hf import convert_from_hf  # heavy: torch, imported when the command runs

        summary = convert_from_hf(
            args.load, args.save, tp=args.tp, pp=args.pp, ckpt_format=args.ckpt_format, dtype=args.dtype,
            transformer_impl=args.transformer_impl,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            post_ln_layers=args.mixln_post_ln_layers, alpha=args.mixln_alpha, scheme=args.mixln_scheme,
            tokenizer_model=args.tokenizer_model, overwrite=args.overwrite, progress=not args.no_progress,
        )
        print(f"[mixln-megatron convert] {json.dumps(summary)}")
        flags = " ".join(summary["launch_flags"])
        spec = "mixln_layer_spec" if summary["transformer_impl"] == "transformer_engine" else "mixln_local_layer_spec"
        print(
            f"[mixln-megatron convert] resume with: mixln-megatron pretrain --load {summary['save']} "
            f"--use-checkpoint-args {' '.join(summary['mixln_flags'])}"
            + " <training flags> "
            f"(iteration 'release': no optimizer state, training restarts at iteration 0; keep the padded "
            f"vocabulary {summary['padded_vocab_size']}). Megatron-LM's pretrain_gpt.py needs the model flags "
            f"themselves (its --use-checkpoint-args skips the norm epsilon and rope scaling): {flags}"
            + (f" --spec mixln_megatron.spec {spec}" if summary["post_ln_layers"] or summary["scheme"] != "mixln"
               or summary["layout"] else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
