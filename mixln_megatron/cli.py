"""`mixln-megatron <command> ...`: one command, its sub-commands (COMMANDS; docs/commands.md)
each in its own module, imported only when it runs, so `--help` stays fast. A user error (any
errors.MixLNError) or a usage error ends the command with one line on stderr and exit status 2,
never a traceback (cli_parsing).
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib import metadata

from . import __version__
from .cli_parsing import CommandParser, add_flag, refused
from .errors import EXIT_STATUS, MixLNError
from .known_warnings import quiet_known_warnings
from .model import hybrid_pattern
from .model.placement import resolve_placement
from .model.settings import FIELDS, MixLNSettings

COMMANDS = {
    "pretrain": ("mixln_megatron.training.pretrain", "Pretrain with Megatron-LM's training loop (Mix-LN spec, --mixln-* flags)."),
    "preprocess": ("mixln_megatron.data.preprocess", "Turn JSONL / text into a Megatron indexed dataset (offline)."),
    "convert": ("mixln_megatron.convert.cli", "Convert checkpoints: to-hf, from-hf, gpt-to-hybrid, hybrid-to-gpt, inspect."),
    "analyze": ("mixln_megatron.analysis.cli", "Diagnostics: grad-norms, angular-distance, layer-drop, train-health."),
    "placement": ("mixln_megatron.cli", "Print which layers are Post-LN for a model shape."),
    "arms": ("mixln_megatron.analysis.arms", "The arms of the paper's comparison: a table, or one arm's MIXLN_* exports."),
}


def _usage() -> str:
    lines = ["usage: mixln-megatron <command> [args]   (mixln-megatron <command> --help: its flags)", "",
             "commands:"]
    lines += [f"  {name:11s} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help   this list", "  --version    the package version"]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version, else the package's own (a source tree on PYTHONPATH)."""
    try:
        return metadata.version("mixln-megatron")
    except metadata.PackageNotFoundError:
        return __version__


def placement_parser() -> CommandParser:
    parser = CommandParser(prog="mixln-megatron placement", description="Show the Post-LN layers.")
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--num-layers", type=int, help="transformer layers of a GPT model")
    shape.add_argument("--hybrid-layer-pattern", type=str, help="a HybridModel pattern '*-*-...' (L blocks)")
    group = parser.add_mutually_exclusive_group()
    # The same names and help as Megatron-LM's --mixln-* flags (settings.FIELDS); the old spellings still work.
    help_of = {flag: help_text for _, flag, _, _, help_text in FIELDS}
    for name in ("--mixln-alpha", "--mixln-post-ln-layers", "--mixln-layout"):
        add_flag(group, name, "--" + name[len("--mixln-"):], help=help_of[name],
                 type=int if name == "--mixln-post-ln-layers" else str)
    for name in ("--mixln-scheme", "--mixln-deepnorm-alpha", "--mixln-deepnorm-beta"):
        add_flag(parser, name, "--" + name[len("--mixln-"):], help=help_of[name], type=str)
    return parser


def placement_main(argv=None) -> int:
    args = placement_parser().parse_args(argv)
    fields = ("alpha", "post_ln_layers", "layout", "scheme", "deepnorm_alpha", "deepnorm_beta")
    settings = MixLNSettings(**{field: getattr(args, "mixln_" + field) for field in fields},
                             sources={field: "--mixln-" + field.replace("_", "-") for field in fields})
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
    if argv[0] in ("--version", "-V"):
        print(f"mixln-megatron {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    quiet_known_warnings()  # before any sub-command imports torch or megatron-core
    if command not in COMMANDS:
        print(f"mixln-megatron: error: unknown command {command!r} (one of {', '.join(COMMANDS)}; see "
              "mixln-megatron --help)", file=sys.stderr)
        return EXIT_STATUS
    try:
        return _run(command, rest)
    except MixLNError as error:  # the commands print their own; this is the backstop
        return refused(f"mixln-megatron {command}", error)
    except BrokenPipeError:
        # the reader went away (`... | head`): stop quietly, and keep Python's exit-time flush of
        # stdout from raising again (the recipe of Python's signal module docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(command: str, rest: list) -> int:
    if command == "placement":
        return placement_main(rest)
    module = importlib.import_module(COMMANDS[command][0])
    if command == "pretrain":
        sys.argv = [f"mixln-megatron {command}", *rest]  # Megatron-LM's parser reads sys.argv
    result = module.main(rest, prog=f"mixln-megatron {command}") if command == "arms" else module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
