"""Every `mixln-megatron` command, sub-command and flag the documentation names is one the CLI has.

The parsers are the real ones (each command's own argparse parser; `pretrain`'s is Megatron-LM's
with the entry point's flags), walked for their sub-commands and option strings. A mention is:
- in a code block or a code span, `mixln-megatron <command> [<sub-command>] ... --flag ...`, or
  `python -m <a command's module> ... --flag` (`-m mixln_megatron.training.pretrain` is `pretrain`);
- in a code span, a short form that starts with a command name (`convert inspect --check`,
  `pretrain --load`);
- in a table row whose first cell names commands (commands.md's table of flag spellings):
  every `--flag` span of the row.
A flag after a command whose sub-command is not named (`analyze ... --load`) must belong to one of
its sub-commands. Placeholders (`<flags>`, `...`, `CKPT_DIR`) are skipped; a quoted message
(`mixln-megatron pretrain: error: ...`) is no invocation.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
from pathlib import Path

import pytest

from mixln_megatron.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "patches" / "README.md",
         ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "examples").glob("*.md"))]
TOP_LEVEL_FLAGS = {"-h", "--help", "--version", "-V"}
PROGRAM = "mixln-megatron"


# ------------------------------------------------------------------------------------ the real parsers
def _pretrain_parser() -> argparse.ArgumentParser:
    """The parser `mixln-megatron pretrain` parses with: Megatron-LM's flags plus the entry point's."""
    from megatron.training.arguments import add_megatron_arguments

    from mixln_megatron.training.pretrain import add_pretrain_args

    return add_pretrain_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def _placement_parser() -> argparse.ArgumentParser:
    from mixln_megatron.cli import placement_parser

    return placement_parser()


def _built_by_module(command: str):
    return lambda: importlib.import_module(COMMANDS[command][0]).build_parser()


PARSERS = {"pretrain": _pretrain_parser, "placement": _placement_parser,
           **{name: _built_by_module(name) for name in ("preprocess", "convert", "analyze", "arms")}}


def _train_health_parser() -> argparse.ArgumentParser:
    from mixln_megatron.analysis.train_health import build_parser

    return build_parser()


# sub-commands whose own module parses their arguments (the command's parser only names them)
DELEGATED = {("analyze", "train-health"): _train_health_parser}


def test_every_command_has_its_parser_here():
    assert set(PARSERS) == set(COMMANDS), "a command was added or removed: give PARSERS its parser"
    for (command, sub), build in DELEGATED.items():
        assert sub in _sub_parsers(PARSERS[command]()) and _options(build()) - {"-h", "--help"}


def _sub_parsers(parser: argparse.ArgumentParser) -> dict:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def _options(parser: argparse.ArgumentParser) -> set:
    return {option for action in parser._actions for option in action.option_strings}


@functools.lru_cache(maxsize=None)
def cli() -> dict:
    """{command: (its options, {sub-command: its options})}."""
    tree = {}
    for command, build in PARSERS.items():
        parser = build()
        subs = {name: DELEGATED.get((command, name), lambda sub=sub: sub)()
                for name, sub in _sub_parsers(parser).items()}
        tree[command] = (frozenset(_options(parser)), {name: frozenset(_options(sub)) for name, sub in subs.items()})
    return tree


MODULES = {module: command for command, (module, _) in COMMANDS.items() if module != "mixln_megatron.cli"}


# ------------------------------------------------------------------------------------ mentions in a page
FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S)
SPAN = re.compile(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)")  # a span may wrap, not cross a blank line
FLAG = re.compile(r"^-(?:-[A-Za-z][\w-]*|[A-Za-z])$")
# where a shell command ends: a pipe into another program, a list operator, a comment, a subshell's end
COMMAND_END = re.compile(r"\|\|?(?!\s*[\[-])|&&|;|\)\s*$|(?:^|\s)#|\$\(|`|>")


def _words(text: str) -> list:
    """The shell words of one command (brackets, commas and `=value` of flags taken off)."""
    words = []
    for word in text.split():  # a wrapped span's newline is a space
        word = word.strip("[](){},'\"")
        if word.startswith("--") and "=" in word:
            word = word.split("=", 1)[0]
        if word:
            words.append(word)
    return words


def _placeholder(word: str) -> bool:
    return word.startswith(("<", "$", "...")) or word.endswith(">") or word == "|"


def invocation_problems(words: list) -> list:
    """What is wrong with one invocation, words[0] being the command name (or a top-level flag)."""
    if not words or _placeholder(words[0]) or words[0].endswith(":"):
        return []  # `mixln-megatron <command> --help`, or a quoted message
    command, rest = words[0], words[1:]
    if command in TOP_LEVEL_FLAGS:
        return []
    if command not in COMMANDS:
        return [f"{PROGRAM} has no command {command!r} (its commands: {', '.join(COMMANDS)})"]
    options, subs = cli()[command]
    problems, sub, allowed, name = [], None, options, command
    if rest and subs and not rest[0].startswith("-") and not _placeholder(rest[0]):
        if rest[0].endswith(":"):
            return []  # `mixln-megatron convert to-hf: error: ...`
        sub = rest[0]
        if sub not in subs:
            return [f"{PROGRAM} {command} has no sub-command {sub!r} (its sub-commands: {', '.join(subs)})"]
        allowed, name, rest = options | subs[sub], f"{command} {sub}", rest[1:]
    elif subs:  # no sub-command named: the flag must belong to one of them
        allowed = options.union(*subs.values())
    for word in rest:
        if word.endswith(":"):
            break  # the rest is a quoted message
        if FLAG.match(word) and word not in allowed:
            problems.append(f"{PROGRAM} {name} has no flag {word}")
    return problems


def _commands_in(line: str, short_form: bool) -> list:
    """The invocations on one line of code: each a list of words, starting at the command name."""
    found = []
    for match in re.finditer(rf"(?<![\w/.-]){PROGRAM}(?![\w-])|(?<!\S)-m\s+(mixln_megatron[\w.]*)", line):
        tail = line[match.end():]
        end = COMMAND_END.search(tail)
        words = _words(tail[:end.start()] if end else tail)
        if match.group(1):  # python -m <module>: its command's words
            if match.group(1) not in MODULES:
                continue
            words = [MODULES[match.group(1)], *words]
        found.append(words)
    if short_form and not found:
        words = _words(line)
        if words and words[0] in COMMANDS:
            found.append(words)
    return found


def _logical_lines(block: str) -> list:
    """A code block's lines, continuation lines (`\\` at the end) joined, `$ ` prompts dropped."""
    joined = re.sub(r"\\\n", " ", block)
    return [re.sub(r"^\s*\$\s+", "", line) for line in joined.splitlines()]


def _table_rows(text: str) -> list:
    """The rows of every table whose first cell names commands in code spans: (commands, flags)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = line.strip().strip("|").split("|")
        named = SPAN.findall(cells[0])
        if not cells[0].strip().startswith("`") or not _words(named[0]) or _words(named[0])[0] not in COMMANDS:
            continue
        first = _words(named[0])
        commands = [first[:2]]
        for span in named[1:]:  # `analyze angular-distance`, `layer-drop`: a sibling sub-command
            words = _words(span)
            if words and words[0] in COMMANDS:
                commands.append(words[:2])
            elif len(first) > 1 and not first[1].startswith("-") and re.fullmatch(r"[a-z][a-z-]*", span):
                commands.append([first[0], span])
        flags = [w for cell in cells[1:] for span in SPAN.findall(cell) for w in _words(span) if FLAG.match(w)]
        rows.append((commands, flags))
    return rows


def page_problems(text: str) -> list:
    problems = []
    blocks = [m.group(2) for m in FENCE.finditer(text)]
    for block in blocks:
        for line in _logical_lines(block):
            for words in _commands_in(line, short_form=False):
                problems += invocation_problems(words)
    prose = FENCE.sub("", text)
    for span in SPAN.findall(prose):
        for words in _commands_in(span, short_form=True):
            problems += invocation_problems(words)
    for commands, flags in _table_rows(prose):
        problems += [f"table row of {' / '.join(' '.join(c) for c in commands)}: {problem}"
                     for commands_problems in [[invocation_problems(c) for c in commands]]
                     for problem in sum(commands_problems, [])]
        for flag in flags:
            if all(invocation_problems([*c, flag]) for c in commands):
                problems.append(f"table row of {' / '.join(' '.join(c) for c in commands)}: no such command has {flag}")
    return sorted(set(problems))


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_the_docs_name_only_commands_and_flags_the_cli_has(page):
    problems = page_problems(page.read_text(encoding="utf-8"))
    assert not problems, f"{page.relative_to(ROOT).as_posix()}:\n  " + "\n  ".join(problems)


def test_the_mentions_are_found():
    """The reader sees every form of mention, so a clean page means something."""
    text = "\n".join([
        "```console",
        "$ mixln-megatron convert to-hf --load CKPT --save HF \\",
        "    --tokenizer-model TOK [--ckpt-step N]",
        "$ torchrun --nproc-per-node 2 -m mixln_megatron.training.pretrain --cpu --mixln-alpha 0.25",
        "$ mixln-megatron analyze train-health RUN_DIR --out-dir plots | head -3",
        "```",
        "Run `mixln-megatron placement --num-layers 4 --mixln-alpha 0.25`, `convert inspect --check --load D`.",
        "| command | old | new |", "|---|---|---|",
        "| `analyze angular-distance`, `layer-drop` | `--megatron` | `--load` |",
    ])
    assert page_problems(text) == []
    lines = [line for block in FENCE.finditer(text) for line in _logical_lines(block.group(2))]
    assert [w[:2] for line in lines for w in _commands_in(line, False)] == [
        ["convert", "to-hf"], ["pretrain", "--cpu"], ["analyze", "train-health"]]


@pytest.mark.parametrize("wrong, expected", [
    ("`mixln-megatron to-hf --load CKPT`", "no command 'to-hf'"),
    ("`mixln-megatron convert to-hff --load CKPT`", "no sub-command 'to-hff'"),
    ("`mixln-megatron convert to-hf --tokeniser-model TOK`", "convert to-hf has no flag --tokeniser-model"),
    ("`convert inspect --chek --load D`", "convert inspect has no flag --chek"),
    ("`analyze ... --lode CKPT`", "analyze has no flag --lode"),
    ("```bash\nmixln-megatron placement --num-layers 4 \\\n  --mixln-alfa 0.25\n```", "placement has no flag --mixln-alfa"),
    ("```console\n$ torchrun -m mixln_megatron.training.pretrain --mixln-post-ln-layer 2\n```",
     "pretrain has no flag --mixln-post-ln-layer"),
    ("| command | old |\n|---|---|\n| `convert from-hf` | `--post-ln-layer` |", "no such command has --post-ln-layer"),
])
def test_the_check_can_fail(wrong, expected):
    assert any(expected in problem for problem in page_problems(wrong)), page_problems(wrong)
