"""`mixln-megatron <command> ...`: one command, sub-commands implemented in their own modules.

    mixln-megatron pretrain  [Megatron-LM args] [--mixln-*]   Megatron-LM training loop with Mix-LN
    mixln-megatron preprocess ...                              corpus -> Megatron indexed dataset
    mixln-megatron convert to-hf | from-hf | gpt-to-hybrid | hybrid-to-gpt | inspect ...
                                                               checkpoints: Megatron <-> HF, GPT <-> Hybrid
    mixln-megatron analyze grad-norms | angular-distance | layer-drop | train-health ...
    mixln-megatron placement --num-layers L [--alpha A | --post-ln-layers P | --layout TEXT]

Each sub-command's module is imported only when it runs, so `--help` stays fast. A user error
(any mixln_megatron.errors.MixLNError: a bad setting, an unsupported configuration, a refused
conversion) ends the command with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import importlib
import sys

from .errors import MixLNError, one_line

COMMANDS = {
    "pretrain": ("mixln_megatron.training.pretrain", "Pretrain with Megatron-LM's training loop (Mix-LN spec, --mixln-* flags)."),
    "preprocess": ("mixln_megatron.data.preprocess", "Turn JSONL / text into a Megatron indexed dataset (offline)."),
    "convert": ("mixln_megatron.convert.cli", "Convert checkpoints: to-hf, from-hf, gpt-to-hybrid, hybrid-to-gpt, inspect."),
    "analyze": ("mixln_megatron.analysis.cli", "Diagnostics: grad-norms, angular-distance, layer-drop, train-health."),
    "placement": ("mixln_megatron.cli", "Print which layers are Post-LN for a model shape."),
}


def _usage() -> str:
    lines = ["usage: mixln-megatron <command> [args]", "", "commands:"]
    lines += [f"  {name:11s} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def placement_main(argv=None) -> int:
    import argparse

    from .model import hybrid_pattern
    from .model.placement import resolve_placement
    from .model.settings import MixLNSettings

    parser = argparse.ArgumentParser(prog="mixln-megatron placement", description="Show the Post-LN layers.")
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--num-layers", type=int, help="transformer layers of a GPT model")
    shape.add_argument("--hybrid-layer-pattern", type=str, help="a HybridModel pattern '*-*-...' (L blocks)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--alpha", type=str)
    group.add_argument("--post-ln-layers", type=int)
    group.add_argument("--layout", type=str, help="per-layer kinds, e.g. 'deepnorm:1-2,pre:3-' (model.layout)")
    parser.add_argument("--scheme", type=str)
    parser.add_argument("--deepnorm-alpha", type=str)
    parser.add_argument("--deepnorm-beta", type=str)
    args = parser.parse_args(argv)
    settings = MixLNSettings(alpha=args.alpha, post_ln_layers=args.post_ln_layers, layout=args.layout,
                             scheme=args.scheme, deepnorm_alpha=args.deepnorm_alpha, deepnorm_beta=args.deepnorm_beta,
                             sources={"alpha": "--alpha", "post_ln_layers": "--post-ln-layers", "layout": "--layout",
                                      "scheme": "--scheme", "deepnorm_alpha": "--deepnorm-alpha",
                                      "deepnorm_beta": "--deepnorm-beta"})
    if args.hybrid_layer_pattern is None:
        print(resolve_placement(args.num_layers, settings).describe())
        return 0
    placement = resolve_placement(hybrid_pattern.check_pattern(args.hybrid_layer_pattern), settings)
    print(placement.describe())
    post = [n for k in placement.post_ln_layer_numbers for n in hybrid_pattern.layer_numbers_of_block(k)]
    print(f"HybridModel layers (1-based): {', '.join(map(str, post)) or 'none'} Post-LN, of {2 * placement.num_layers}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"mixln-megatron: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return _run(command, rest)
    except MixLNError as error:
        print(f"mixln-megatron {command}: error: {one_line(error)}", file=sys.stderr, flush=True)
        return 2


def _run(command: str, rest: list) -> int:
    if command == "placement":
        return placement_main(rest)
    module = importlib.import_module(COMMANDS[command][0])
    if command == "pretrain":
        sys.argv = [f"mixln-megatron {command}", *rest]  # Megatron-LM's parser reads sys.argv
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
