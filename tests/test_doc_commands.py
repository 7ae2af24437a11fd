"""Every shell command in the user documentation exists as written, and the cheap ones run.

The fenced ```bash / ```sh / ```console blocks of README.md, docs/*.md, CONTRIBUTING.md and
benchmarks/README.md are extracted. Each block is either run on the CPU (offline, in a temporary
folder, the venv's commands first on PATH) or named in NOT_RUN with the reason it cannot run here
(a GPU, a cluster, data the reader brings, or a cost only worth paying in its own test). Every
command of every block, run or not, is checked against the code: `mixln-megatron` sub-commands and
their flags against the command's own --help, `python -m` modules (and their flags), script paths
and the flags a script defines, make targets, setup.py extras, `--spec MODULE NAME` objects and
repository paths. So a renamed flag, target, script or spec fails here before a user meets it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import itertools
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent  # the venv's python, mixln-megatron and torchrun

# (file, the block's first command) -> why it is not run here. Its commands are still checked.
GPU, CLUSTER, DATA = "needs a GPU", "a multi-node cluster launch", "needs the reader's own checkpoint, data or folders"
NOT_RUN = {
    ("README.md", "make demo"): "trains two models for minutes: make demo is its own check",
    ("README.md", "pip install -e ."): "installs packages (network)",
    ("README.md", "export MIXLN_ALPHA=0.0625"): CLUSTER,
    ("README.md", "MEGATRON_LM_DIR=/opt/Megatron-LM DATA_PATH=/data/c4/c4_en_t5_text_document TOKENIZER_MODEL=/data/tokenizers/t5-base bash examples/pretrain_llama1b_mixln.sh"): GPU,
    ("README.md", "mixln-megatron convert to-hf --load CKPT_DIR --save HF_DIR --tokenizer-model TOK_DIR"): DATA,
    ("README.md", "mixln-megatron convert inspect --check --load CKPT_DIR"): DATA,
    ("README.md", "mixln-megatron convert inspect --load CKPT_DIR"): DATA,
    ("CONTRIBUTING.md", "make setup"): "installs the venv (network); the suite itself runs in it",
    ("CONTRIBUTING.md", ".venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_placement.py -k bad"): "runs tests: the suite's own business",
    ("CONTRIBUTING.md", "PYTHONPATH=$(scripts/compat_env.sh 0.18) COMPAT_MEGATRON_RELEASE=0.18 .venv/bin/python -m pytest -q -m compat tests"): "lays out megatron-core 0.18 (network) and runs a test tier",
    ("benchmarks/README.md", ".venv/bin/python benchmarks/schemes.py --quick"): "a benchmark of minutes",
    ("benchmarks/README.md", ".venv/bin/python benchmarks/fidelity.py [--quick]"): "a benchmark of minutes",
    ("benchmarks/README.md", ".venv/bin/python benchmarks/unpickler_choice.py --layout 80,8,16 --runs 5"): "a benchmark of minutes (tests/test_unpickler_hardening.py covers the unpickler it compares)",
    ("benchmarks/README.md", ".venv/bin/python benchmarks/vetting.py --quick"): "a benchmark in fresh processes (tests/test_scale_vetting.py covers the vetting)",
    ("benchmarks/README.md", "mixln-megatron analyze grad-norms --num-layers 12 --hidden-size 128 --mixln-alpha 0.25 [--embedding-std reference]"): "a benchmark of minutes",
    ("benchmarks/README.md", "benchmarks/gpu_check.sh"): GPU + " (the --cpu-dry-run lines run in tests/test_gpu_check_dryrun.py)",
    ("docs/training.md", "export MIXLN_ALPHA=0.0625"): CLUSTER + " (the GPTModel and the HybridModel block)",
    ("docs/training.md", "git apply --check /path/to/mixln_megatron/patches/core_r0.19.0/0001-mixln-cli-flags.patch"): "needs a Megatron-LM checkout (tests/test_patches.py applies the patches)",
    ("docs/training.md", "bash examples/cpu_tiny_mixln.sh"): "trains for a minute: tests/test_launchers.py runs the launchers",
    ("docs/training.md", "MEGATRON_LM_DIR=/path/to/Megatron-LM MIXLN_ALPHA=0.5 python -m torch.distributed.run --nproc_per_node 1 scripts/run_megatron_lm_cpu.py <pretrain_gpt.py args>"): "needs a Megatron-LM checkout",
    ("docs/configuration.md", "for ARM in pre_ln post_ln deepnorm deepnorm_authors sandwich lns mix_ln mix_deepnorm pre_post post_every4 pre_every4 pre_sandwich; do"): CLUSTER,
    ("docs/configuration.md", 'eval "$(mixln-megatron arms --num-layers 32 --mixln-alpha 0.0625 mix_deepnorm)"'): CLUSTER + " (SLURM)",
    ("docs/training.md", "NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MEGATRON_LM_DIR=/opt/Megatron-LM DATA_PATH=/data/c4/c4_en_t5_text_document TOKENIZER_MODEL=/data/tokenizers/t5-base bash examples/pretrain_moe16b_a2b_mixln.sh"): CLUSTER,
    ("docs/training.md", "mixln-megatron pretrain <Megatron-LM pretrain_gpt.py flags> --mixln-alpha 0.25"): GPU,
    ("docs/training.md", "make demo"): "trains two models for minutes: make demo is its own check",
    ("docs/training.md", 'torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m mixln_megatron.training.pretrain <model, data and training flags> --mixln-alpha 0.25 --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"'): CLUSTER + " (tests/test_multinode.py runs it as two agents on one machine)",
    ("docs/commands.md", "mixln-megatron preprocess -i corpus.jsonl -o data/corpus --append-eod --overwrite --split-sentences --workers 4"): "a minute of worker start-up on 2 cores; the block above runs",
    ("docs/configuration.md", "export MIXLN_SPIKE_SCALER=1"): GPU,
    ("docs/configuration.md", "mixln-megatron pretrain <flags> --mixln-telemetry-interval 10 --save runs/mixln"): GPU,
    ("docs/conversion.md", "mixln-megatron convert to-hf --load CKPT_DIR [--ckpt-step N] --save HF_DIR [--dtype bfloat16] [--tokenizer-model TOK_DIR]"): DATA,
    ("docs/untrusted-input.md", "mixln-megatron convert inspect --check --load DIR [--ckpt-step N]"): DATA,
    ("docs/commands.md", "mixln-megatron analyze grad-norms --num-layers 12 --mixln-alpha 0.25 [--embedding-std megatron|reference]"): DATA + " (and minutes)",
}
RUN_TIMEOUT_S = 600  # generous: a loaded 2-core machine

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>bash|sh|console)[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
SEPARATORS = {";", "&&", "||", "|", "do", "then", "done", "fi", "else"}
PLACEHOLDER = re.compile(r"<[^<>\n]*>")  # <Megatron-LM pretrain_gpt.py flags>, <(8L)^(1/4)>
REPO_DIRS = ("examples/", "benchmarks/", "scripts/", "tests/", "patches/", "docs/", "mixln_megatron/", ".ci/")


# ------------------------------------------------------------------------------------ extraction
def logical_lines(lang: str, body: str) -> list:
    """A block's commands, one per logical line (continuations joined; console output dropped)."""
    lines, current, in_command = [], "", lang != "console"
    for raw in textwrap.dedent(body).splitlines():
        if lang == "console" and not current:
            in_command = raw.startswith("$ ")
            raw = raw[2:] if in_command else raw
        if not in_command:
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        line = (current + raw).strip()
        current = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def blocks():
    found = []
    for doc in DOCS:
        for match in FENCE.finditer(doc.read_text(encoding="utf-8")):
            commands = logical_lines(match["lang"], match["body"])
            if commands:
                found.append((doc.relative_to(ROOT).as_posix(), match["lang"], commands, match["body"]))
    return found


def block_key(block) -> tuple:
    """(file, the block's first command without its comment): how NOT_RUN names a block."""
    return block[0], re.sub(r"\s+", " ", re.sub(r"\s#\s.*$", "", block[2][0])).strip()


SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")


def words(line: str) -> list:
    """Shell words of one line: optional [...] brackets and `#` comments dropped, a <placeholder>
    kept as one word, a $(...) substitution as the word SUBST (its command is checked on its own)."""
    line = PLACEHOLDER.sub(lambda m: m.group(0).replace(" ", "_"), SUBSTITUTION.sub("SUBST", line))
    lexer = shlex.shlex(line.replace("[", " ").replace("]", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


def simple_commands(line: str) -> list:
    """The simple commands of a line: split at ; && || | and loop words, $(...) included."""
    found = [command for inner in SUBSTITUTION.findall(line) for command in simple_commands(inner)]
    current = []
    for word in words(line):
        if word in SEPARATORS:
            found += [current] if current else []
            current = []
        elif word.startswith("-") and not current and found:
            found[-1].append(word)  # `--megatron DIR | --hf DIR`: alternatives of the same command
        else:
            current.append(word)
    return found + ([current] if current else [])


# ------------------------------------------------------------------------------------ what exists
@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


@functools.lru_cache(maxsize=None)
def setup_extras() -> frozenset:
    text = (ROOT / "setup.py").read_text()
    body = text[text.index("extras_require"):]
    return frozenset(re.findall(r'^\s*"([\w-]+)"\s*:\s*\[', body, re.M))


def option_strings(help_text: str) -> set:
    """The flags a --help names, less those it calls a deprecated spelling (the docs use the new)."""
    flat = re.sub(r"\s+", " ", help_text)
    deprecated = {flag for names in re.findall(r"deprecated spellings?: ([-\w, ]+)", flat)
                  for flag in re.findall(r"--?[A-Za-z][\w-]*", re.sub(r"(?<=\w-) (?=\w)", "", names))}
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", flat)) - deprecated


@functools.lru_cache(maxsize=None)
def cli_help(*path: str) -> str:
    """`mixln-megatron PATH... --help`, in this process (the imports are paid once)."""
    from mixln_megatron import cli

    out, argv = io.StringIO(), list(sys.argv)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                status = cli.main([*path, "--help"])
            except SystemExit as stop:
                status = stop.code
    finally:
        sys.argv[:] = argv
    assert status in (0, None), f"`mixln-megatron {' '.join(path)} --help` failed ({status})"
    return out.getvalue()


@functools.lru_cache(maxsize=None)
def module_help(module: str) -> str:
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=clean_env())
    assert done.returncode == 0, f"`python -m {module} --help` failed: {done.stderr[-400:]}"
    return done.stdout


@functools.lru_cache(maxsize=None)
def megatron_flags() -> frozenset:
    """The flags Megatron-LM's parser takes (what pretrain_gpt.py and the entry point accept)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_megatron_arguments(parser)
    return frozenset(parser._option_string_actions)


@functools.lru_cache(maxsize=None)
def defined_in_source(flag: str, *paths: Path) -> bool:
    """The flag is a string literal of one of the files (how argparse and bash scripts define them)."""
    return any(p.exists() and re.search(rf"['\"]{re.escape(flag)}['\"]", p.read_text()) for p in paths)


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


# ------------------------------------------------------------------------------------ the checks
def flags(args) -> list:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def check_mixln_megatron(args, where):
    from mixln_megatron.cli import COMMANDS

    if args and args[0].startswith("-"):  # the command's own flags: --version, --help
        assert args[0] in option_strings(cli_help()), f"{where}: `mixln-megatron` has no flag {args[0]}"
        return
    assert args and args[0] in COMMANDS, f"{where}: `mixln-megatron {' '.join(args[:1])}` is no sub-command"
    path = [args[0]]
    if args[0] in ("convert", "analyze"):
        choices = re.search(r"\{([\w,-]+)\}", cli_help(args[0])).group(1).split(",")
        assert len(args) > 1 and args[1] in choices, f"{where}: `mixln-megatron {args[0]} {args[1:2]}` is no sub-command"
        path.append(args[1])
    if args[0] == "pretrain":
        return check_pretrain_flags(args[1:], where)
    known = option_strings(cli_help(*path))
    for flag in flags(args[len(path):]):
        assert flag in known, f"{where}: `mixln-megatron {' '.join(path)}` has no flag {flag}"


def check_pretrain_flags(args, where):
    """The entry point takes its own and the --mixln-* flags (its --help) and Megatron-LM's."""
    known = option_strings(cli_help("pretrain"))
    for flag in flags(args):
        assert flag in known or flag in megatron_flags(), \
            f"{where}: neither mixln-megatron pretrain nor Megatron-LM's parser has {flag}"


def check_spec(args, where):
    for i, word in enumerate(args[:-2]):
        if word == "--spec":
            module, name = args[i + 1], args[i + 2]
            assert hasattr(importlib.import_module(module), name), f"{where}: --spec {module} {name} does not exist"


def check_python(args, where):
    """`python -m MODULE ...` or `python SCRIPT ...`."""
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        if module == "mixln_megatron.training.pretrain":
            check_pretrain_flags(rest, where)
        elif module == "torch.distributed.run":
            check_launch(rest, where)
        elif module.startswith("mixln_megatron.") and flags(rest):
            known = option_strings(module_help(module))
            for flag in flags(rest):
                assert flag in known, f"{where}: `python -m {module}` has no flag {flag}"
        return
    script, rest = args[0], args[1:]
    check_script(script, rest, where)


def check_script(script, rest, where):
    path = ROOT / script
    assert path.exists(), f"{where}: {script} does not exist"
    sources = script_sources(path)
    for flag in flags(rest):
        assert flag == "--help" or defined_in_source(flag, *sources), f"{where}: {script} defines no flag {flag}"


def script_sources(path: Path) -> tuple:
    """Where a script's flags can be defined: itself, its .py twin (a .sh wrapper), and the modules
    of its own folder that these import (a shared argument parser)."""
    own = [path] + ([path.with_suffix(".py")] if path.suffix == ".sh" else [])
    imported = {name for p in own if p.exists()
                for name in re.findall(r"^\s*(?:from|import)\s+(\w+)", p.read_text(), re.M)}
    return tuple(own + [path.parent / f"{name}.py" for name in sorted(imported)])


def check_launch(args, where):
    """torchrun's own flags, then a script or `-m module` and its arguments."""
    for i, word in enumerate(args):
        if word == "-m":
            return check_python(args[i:], where)
        if word.endswith(".py"):
            if word in ("pretrain_gpt.py", "pretrain_hybrid.py"):  # Megatron-LM's own scripts
                for flag in flags(args[i + 1:]):
                    assert flag in megatron_flags(), \
                        f"{where}: Megatron-LM's parser has no flag {flag}"
                return
            return check_script(word, args[i + 1:], where)


def check_command(words_, where):
    while words_ and (re.match(r"^[A-Za-z_]\w*=", words_[0]) or words_[0] in ("export", "eval", "time", "for", "in")):
        if words_[0] == "for":
            return
        words_ = words_[1:]
    if not words_:
        return
    head, args = words_[0], words_[1:]
    check_spec(words_, where)
    for word in words_:  # repository paths named anywhere
        if word.startswith(REPO_DIRS) and not any(c in word for c in "*<$"):
            assert (ROOT / word.rstrip("/")).exists(), f"{where}: {word} does not exist"
    name = Path(head).name
    if name == "make":
        for target in (a for a in args if not a.startswith("-") and "=" not in a):
            assert target in make_targets(), f"{where}: the Makefile has no target {target!r}"
    elif name == "mixln-megatron":
        check_mixln_megatron(args, where)
    elif re.fullmatch(r"python(3(\.\d+)?)?", name):
        check_python(args, where)
    elif name == "torchrun":
        check_launch(args, where)
    elif name in ("bash", "sh", "sbatch"):
        check_script(next(a for a in args if not a.startswith("-")), [], where)
    elif name == "pip" and "install" in args:
        for extra in re.findall(r"\[([\w,-]+)\]", " ".join(args)):
            for one in extra.split(","):
                assert one in setup_extras(), f"{where}: setup.py has no extra {one!r}"
    elif name == "git" and args[:1] == ["apply"]:
        for patch in (a for a in args if a.endswith(".patch")):
            local = re.sub(r"^.*?/mixln_megatron/(?=patches/)", "", patch)
            assert (ROOT / local).exists(), f"{where}: {local} does not exist"
    elif head.startswith(REPO_DIRS):
        check_script(head, args, where)


BLOCKS = blocks()


def test_the_documentation_has_shell_blocks():
    assert len(BLOCKS) > 20 and {b[0] for b in BLOCKS} >= {"README.md", "CONTRIBUTING.md", "benchmarks/README.md"}


def test_every_listed_block_still_exists():
    keys = {block_key(b) for b in BLOCKS}
    gone = [key for key in NOT_RUN if key not in keys]
    assert not gone, f"NOT_RUN names blocks that no longer exist (update the list): {gone}"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}:{b[2][0][:60]}")
def test_commands_exist(block):
    """Every command, flag, target, path, extra and --spec a block names exists."""
    for line in block[2]:
        for command in simple_commands(line):
            check_command(command, f"{block[0]}: `{line[:100]}`")


RUNNABLE = [b for b in BLOCKS if block_key(b) not in NOT_RUN]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"{b[0]}:{b[2][0][:60]}")
def test_block_runs_on_cpu(block, tmp_path):
    """Blocks not in NOT_RUN run as written, offline, in an empty folder."""
    assert block[1] != "console" or all("<" not in line for line in block[2]), "a placeholder cannot run"
    script = "set -euo pipefail\n" + "\n".join(block[2]) + "\n"
    env = clean_env() | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{block[0]}: the block\n{script}\nfailed ({done.returncode}):\n{done.stderr[-2000:]}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    """A moved or renamed doc page fails here, not in a reader's browser."""
    text = doc.read_text(encoding="utf-8")
    broken = [target for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
              if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files {broken}"


# ------------------------------------------------------------------------------------ launcher variables
LAUNCHER_OF_MODEL = {"1b": "pretrain_llama1b_mixln.sh", "7b": "pretrain_llama7b_mixln.sh",
                     "moe16b": "pretrain_moe16b_a2b_mixln.sh"}


def required_variables(script: Path, assigned: dict) -> set:
    """The variables a launcher stops without (`${VAR:?...}`), and those of the launcher
    compare_schemes.sh hands over to (by MODEL, default 1b)."""
    needed = set(re.findall(r"\$\{(\w+):\?", script.read_text()))
    if script.name == "compare_schemes.sh":
        model = assigned.get("MODEL", "1b")
        if model in LAUNCHER_OF_MODEL:
            needed |= required_variables(script.parent / LAUNCHER_OF_MODEL[model], assigned)
    return needed


def unset_launcher_variables(block) -> list:
    """`VAR (script)` for each variable a launcher in the block requires that the block does not set."""
    exported, missing = {}, []
    for line in block[2]:
        for command in simple_commands(line):
            if command[:1] == ["export"]:
                exported.update(w.split("=", 1) for w in command[1:] if "=" in w)
                continue
            prefix = dict(w.split("=", 1) for w in itertools.takewhile(lambda w: re.match(r"^[A-Za-z_]\w*=", w), command))
            rest = command[len(prefix):]
            if not rest or Path(rest[0]).name not in ("bash", "sh", "sbatch"):
                continue
            script = next((a for a in rest[1:] if a.startswith("examples/")), None)
            if script is None or not (ROOT / script).exists():
                continue
            assigned = {**exported, **prefix}
            missing += [f"{v} ({script})" for v in sorted(required_variables(ROOT / script, assigned)) if v not in assigned]
    return missing


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}:{b[2][0][:60]}")
def test_launcher_commands_set_what_the_launcher_requires(block):
    """A launcher command as documented does not stop at a missing variable."""
    missing = unset_launcher_variables(block)
    assert not missing, f"{block[0]}: `{block[2][0][:80]}` leaves unset what the launcher requires: {missing}"


def test_the_launcher_variable_check_can_fail():
    block = ("x.md", "console", ["MEGATRON_LM_DIR=/m DATA_PATH=/d bash examples/pretrain_llama1b_mixln.sh"], "")
    assert unset_launcher_variables(block) == ["TOKENIZER_MODEL (examples/pretrain_llama1b_mixln.sh)"]
