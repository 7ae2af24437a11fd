"""How the `mixln-megatron` commands parse their flags and refuse: one line, exit 2.

`CommandParser` for the commands' own parsers, `one_line_usage_errors` for a parser this project
does not own (Megatron-LM's, whose usage message is hundreds of flags long), `add_flag` for a
flag that still takes its old spellings, `refused` for a refusal's line. Flag names follow
Megatron-LM where it has one (--load, --tokenizer-model, --mixln-*), so a setting is spelled the
same in every command.

Pure Python: importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from typing import Iterator

from .errors import EXIT_STATUS, one_line, print_once, reported


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its sub-parsers too: add_subparsers keeps the class)."""

    def error(self, message):
        _usage_error(self, message)


def _usage_error(parser: argparse.ArgumentParser, message: str, once_per_job: bool = False):
    text = " ".join(str(message).split())
    line = f"{parser.prog}: error: {text} (see {parser.prog} --help)"
    if once_per_job:
        print_once(line, alike_on_every_rank=True)
    else:
        print(line, file=sys.stderr, flush=True)
    sys.exit(EXIT_STATUS)


def _usage_error_once_per_job(parser: argparse.ArgumentParser, message: str):
    _usage_error(parser, message, once_per_job=True)


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """While inside, every argparse parser's usage error is one line and exit 2, printed once
    per job (for parsers built by code this project does not own, which every rank runs alike)."""
    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _usage_error_once_per_job
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved


class _Renamed(argparse.Action):
    """Stores the value (like action='store'); an old spelling also prints the deprecation line."""

    def __init__(self, option_strings, dest, *, old=(), **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.old = tuple(old)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.old:
            print(f"{parser.prog}: warning: {option_string} is deprecated, use {self.option_strings[0]}",
                  file=sys.stderr, flush=True)
        setattr(namespace, self.dest, values)


def add_flag(container, name: str, *old: str, help: str, **kwargs):
    """container.add_argument(name, ...) that also accepts the `old` spellings (deprecated); the
    value goes to `name`'s dest. For flags that take a value."""
    if not old:
        return container.add_argument(name, help=help, **kwargs)
    note = f" (deprecated spelling{'s' if len(old) > 1 else ''}: {', '.join(old)})"
    return container.add_argument(name, *old, action=functools.partial(_Renamed, old=old), help=help + note,
                                  **kwargs)


def refused(prog: str, error: BaseException, file=None) -> int:
    """A refusal's one line, `<prog>: error: <message>`, unless errors.report already printed it
    (then not again); returns the exit status of a refusal."""
    if reported(error) is None:
        print(f"{prog}: error: {one_line(error)}", file=file or sys.stderr, flush=True)
    return EXIT_STATUS
