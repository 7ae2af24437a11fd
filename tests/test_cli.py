"""One command line: `mixln-megatron` and every sub-command, through their real parsers and mains.

  - every sub-command's refusal (one bad input each) and usage error: exit 2, exactly one stderr line;
  - the same setting has one name everywhere (Megatron-LM's); each old spelling still parses to the
    same value, with one deprecation line;
  - `--version`; every option of every sub-command has help text (the parser tree is walked);
  - the arms table is a sub-command (and `python -m mixln_megatron.analysis.arms` still works);
  - progress off a terminal is plain lines (no carriage returns), and a large checkpoint read is
    announced before it starts.
"""

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixln_megatron import __version__, cli, progress
from mixln_megatron.analysis import arms
from mixln_megatron.analysis import cli as analyze_cli
from mixln_megatron.analysis import train_health
from mixln_megatron.convert import cli as convert_cli
from mixln_megatron.data import preprocess
from harness.testing import run_python
from mixln_megatron.training import pretrain

REPO = Path(__file__).resolve().parent.parent

# Every renamed flag: (command, its parser, old spelling, new spelling, arguments the parse needs).
RENAMED = [
    ("placement", cli.placement_parser, "--alpha", "--mixln-alpha", ["--num-layers", "8"]),
    ("placement", cli.placement_parser, "--post-ln-layers", "--mixln-post-ln-layers", ["--num-layers", "8"]),
    ("placement", cli.placement_parser, "--layout", "--mixln-layout", ["--num-layers", "8"]),
    ("placement", cli.placement_parser, "--scheme", "--mixln-scheme", ["--num-layers", "8"]),
    ("placement", cli.placement_parser, "--deepnorm-alpha", "--mixln-deepnorm-alpha", ["--num-layers", "8"]),
    ("placement", cli.placement_parser, "--deepnorm-beta", "--mixln-deepnorm-beta", ["--num-layers", "8"]),
    ("arms", arms.build_parser, "--layers", "--num-layers", ["pre_ln"]),
    ("arms", arms.build_parser, "--alpha", "--mixln-alpha", ["--num-layers", "8", "pre_ln"]),
    ("convert to-hf", convert_cli.build_parser, "--tokenizer", "--tokenizer-model",
     ["to-hf", "--load", "a", "--save", "b"]),
    ("convert from-hf", convert_cli.build_parser, "--post-ln-layers", "--mixln-post-ln-layers",
     ["from-hf", "--load", "a", "--save", "b"]),
    ("preprocess", preprocess.build_parser, "--tokenizer-dir", "--tokenizer-model", ["-i", "a", "-o", "b"]),
    ("analyze angular-distance", analyze_cli.build_parser, "--megatron", "--load", ["angular-distance"]),
    ("analyze layer-drop", analyze_cli.build_parser, "--tokenizer", "--tokenizer-model",
     ["layer-drop", "--hf", "a"]),
    ("analyze layer-drop", analyze_cli.build_parser, "--post-ln-layers", "--mixln-post-ln-layers",
     ["layer-drop", "--hf", "a"]),
    ("analyze layer-drop", analyze_cli.build_parser, "--scheme", "--mixln-scheme", ["layer-drop", "--hf", "a"]),
    ("analyze grad-norms", analyze_cli.build_parser, "--alpha", "--mixln-alpha", ["grad-norms"]),
    ("analyze train-health", train_health.build_parser, "--out", "--out-dir", ["run"]),
    # Megatron-LM names the checkpoint step to load --ckpt-step
    ("convert to-hf", convert_cli.build_parser, "--iteration", "--ckpt-step", ["to-hf", "--load", "a", "--save", "b"]),
    ("convert inspect", convert_cli.build_parser, "--iteration", "--ckpt-step", ["inspect", "--load", "a"]),
    ("convert gpt-to-hybrid", convert_cli.build_parser, "--iteration", "--ckpt-step",
     ["gpt-to-hybrid", "--load", "a", "--save", "b"]),
    ("analyze layer-drop", analyze_cli.build_parser, "--iteration", "--ckpt-step", ["layer-drop", "--load", "a"]),
]
VALUES = {"--ckpt-step": "3", "--mixln-scheme": "lns", "--num-layers": "8", "--mixln-post-ln-layers": "2", "--mixln-alpha": "0.25"}


def one_error_line(err: str, command: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{command}: error: "), err
    return lines[0]


def run_cli(capsys, argv):
    """cli.main in-process -> (exit status, stdout, stderr); argparse's SystemExit counts as a status."""
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    except SystemExit as left:
        rc = left.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# ------------------------------------------------------------------ refusals
def test_each_command_refuses_a_bad_input_in_one_line_with_exit_2(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    cases = [
        ("placement", ["placement", "--num-layers", "32"]),  # no Mix-LN setting at 32 layers
        ("arms", ["arms", "--num-layers", "4", "--mixln-alpha", "2", "mix_ln"]),  # a layout beyond L
        ("preprocess", ["preprocess", "-i", missing, "-o", str(tmp_path / "out"), "--no-progress"]),
        ("convert to-hf", ["convert", "to-hf", "--load", missing, "--save", str(tmp_path / "hf")]),
        ("convert inspect", ["convert", "inspect", "--check", "--load", missing]),
        ("analyze grad-norms", ["analyze", "grad-norms", "--num-layers", "0"]),
        ("analyze train-health", ["analyze", "train-health", missing]),  # was exit 1
        ("analyze angular-distance", ["analyze", "angular-distance", "--load", missing]),
    ]
    for command, argv in cases:
        rc, out, err = run_cli(capsys, argv)
        assert rc == 2, (command, rc, err)
        one_error_line(err, f"mixln-megatron {command}")
    assert os.listdir(tmp_path) == []  # nothing written by any of them


def test_usage_errors_are_one_line_with_exit_2(capsys):
    cases = [
        ("mixln-megatron", ["no-such-command"]),
        ("mixln-megatron placement", ["placement"]),
        ("mixln-megatron arms", ["arms", "--num-layers", "8", "no_such_arm"]),
        ("mixln-megatron preprocess", ["preprocess", "-i", "x"]),
        ("mixln-megatron convert", ["convert"]),
        ("mixln-megatron convert from-hf", ["convert", "from-hf", "--load", "a"]),
        ("mixln-megatron analyze layer-drop", ["analyze", "layer-drop"]),
        ("mixln-megatron analyze train-health", ["analyze", "train-health"]),
    ]
    for command, argv in cases:
        rc, _, err = run_cli(capsys, argv)
        assert rc == 2, (command, rc, err)
        one_error_line(err, command)


def test_pretrain_usage_error_is_one_line_not_megatron_s_usage():
    """Megatron-LM's own parser (hundreds of flags): an unknown flag is one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = run_python([sys.executable, "-m", "mixln_megatron.cli", "pretrain", "--cpu", "--no-such-flag", "3"],
                      env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # torch logs one `W.... No CUDA runtime is found` line at import on a machine without CUDA: not ours
    ours = [line for line in proc.stderr.splitlines() if "No CUDA runtime is found" not in line]
    assert len(ours) == 1 and ours[0] == ("mixln-megatron pretrain: error: unrecognized arguments: --no-such-flag 3 "
                                          "(see mixln-megatron pretrain --help)"), proc.stderr[-3000:]


# ------------------------------------------------------------------ one name per setting
@pytest.mark.parametrize("command,parser,old,new,rest", RENAMED, ids=[f"{r[0]}:{r[2]}" for r in RENAMED])
def test_an_old_spelling_still_works_with_one_deprecation_line(command, parser, old, new, rest, capsys):
    value = VALUES.get(new, "x")
    capsys.readouterr()
    with_new = parser().parse_args([*rest, new, value])
    assert capsys.readouterr().err == ""
    with_old = parser().parse_args([*rest, old, value])
    err = capsys.readouterr().err
    assert err.endswith(f": warning: {old} is deprecated, use {new}\n") and err.count("\n") == 1, err
    assert vars(with_old) == vars(with_new)


def test_a_setting_has_one_name_across_commands():
    """No parser keeps an old spelling as a flag of its own: each is only an alias of its new name."""
    for _, make, old, new, _ in RENAMED:
        for parser in walk(make()):
            for action in parser._actions:
                if old in action.option_strings:
                    assert action.option_strings[0] == new, (parser.prog, action.option_strings)


def test_the_old_spellings_behave_in_the_real_commands(capsys):
    rc, out, err = run_cli(capsys, ["placement", "--num-layers", "8", "--alpha", "0.25"])
    assert rc == 0 and "Post-LN layers: 1, 2" in out
    assert err == "mixln-megatron placement: warning: --alpha is deprecated, use --mixln-alpha\n"
    rc, out, _ = run_cli(capsys, ["arms", "--layers", "32", "--alpha", "0.0625", "mix_deepnorm"])
    assert rc == 0 and "export MIXLN_LAYOUT='deepnorm:1-2,pre:*'" in out


# ------------------------------------------------------------------ --version, help, the arms
def test_version(capsys):
    rc, out, _ = run_cli(capsys, ["--version"])
    assert rc == 0 and out == f"mixln-megatron {cli.version()}\n" and cli.version() == __version__


def walk(parser):
    """The parser and every sub-parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from walk(sub)


def test_every_option_of_every_command_has_help():
    roots = [cli.placement_parser(), arms.build_parser(), convert_cli.build_parser(), preprocess.build_parser(),
             analyze_cli.build_parser(), train_health.build_parser(), pretrain.help_parser()]
    missing = []
    for root in roots:
        for parser in walk(root):
            for action in parser._actions:
                if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                    continue
                if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                    missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_the_arms_table_is_a_subcommand(capsys):
    rc, out, _ = run_cli(capsys, ["arms", "--num-layers", "24"])
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert rc == 0 and set(rows) == set(arms.ARM_BY_NAME)
    assert rows["mix_ln"] == "post:1-6,pre:*" and rows["pre_sandwich"] == "pre:1-18,sandwich:*"
    rc, out, _ = run_cli(capsys, ["arms", "--num-layers", "24", "mix_deepnorm"])
    assert rc == 0 and out == "export MIXLN_LAYOUT='deepnorm:1-6,pre:*'\nexport MIXLN_SCHEME=mixln\n"
    proc = run_python([sys.executable, "-m", "mixln_megatron.analysis.arms", "--num-layers", "24", "mix_deepnorm"],
                      capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout == out, proc.stderr


# ------------------------------------------------------------------ progress and announcements
class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    from tqdm import tqdm

    on_terminal = progress.bar(100, "x", file=Terminal())
    assert isinstance(on_terminal, tqdm)
    on_terminal.close()
    log = io.StringIO()
    lines = progress.bar(3 * 2**20, "to-hf out", file=log, interval_s=0)
    lines.update(2**20)
    lines.update(2 * 2**20)
    lines.close()
    assert "\r" not in log.getvalue()
    got = [line.rsplit(",", 1)[0] for line in log.getvalue().splitlines()]
    assert got == ["to-hf out: 1.0 of 3.0 MiB (33%)", "to-hf out: 3.0 of 3.0 MiB (100%)",
                   "to-hf out: 3.0 of 3.0 MiB (100%)"]
    assert log.getvalue().splitlines()[-1].endswith(" done")
    quiet = io.StringIO()
    bar = progress.bar(10, "y", unit="docs", file=quiet)  # the default interval: only the closing line
    bar.update(5)
    bar.close()
    assert quiet.getvalue().count("\n") == 1 and quiet.getvalue().startswith("y: 5 of 10 docs (50%), ")


def test_preprocess_progress_in_a_log_is_plain_lines(tmp_path, capsys):
    """A real preprocess run with its progress on (stderr is not a terminal here)."""
    src = tmp_path / "in.txt"
    src.write_text("One paragraph here.\n\nAnother one there.\n")
    capsys.readouterr()
    assert preprocess.main(["-i", str(src), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1].startswith("preprocess out: ") and err.endswith(" done\n"), err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mixln_megatron.convert import convert_from_hf
    from test_convert import make_mixln_folder

    base = tmp_path_factory.mktemp("cli")
    make_mixln_folder(base / "hf")
    convert_from_hf(str(base / "hf"), str(base / "megatron"), progress=False)
    return base / "megatron"


def test_a_large_checkpoint_read_is_announced_before_it_starts(checkpoint, monkeypatch, capsys):
    iteration = checkpoint / "release"
    rc, out, err = run_cli(capsys, ["convert", "inspect", "--load", str(checkpoint)])
    assert rc == 0 and err == ""  # a small checkpoint: nothing to announce
    monkeypatch.setattr(progress, "ANNOUNCE_BYTES", 1)  # every checkpoint is "large" now
    rc, out, err = run_cli(capsys, ["convert", "inspect", "--load", str(checkpoint)])
    size = os.path.getsize(iteration / ".metadata") / 1e6
    assert rc == 0 and err == f"reading and vetting {iteration}/.metadata ({size:.0f} MB) ...\n"
    rc, out, err = run_cli(capsys, ["convert", "inspect", "--check", "--load", str(checkpoint)])
    count = sum(len(files) for _, _, files in os.walk(iteration))
    assert rc == 0 and err.startswith(f"vetting every pickle in {iteration}: {count} files (") and "clean" in out


def test_pretrain_load_vetting_is_announced_before_it_starts(checkpoint, monkeypatch, capsys):
    """`pretrain --load` vets the checkpoint before Megatron-LM reads it: on a large one, the
    rank that vets says so first."""
    import argparse

    from mixln_megatron.convert.vet import vet_load_args

    iteration = checkpoint / "release"
    args = argparse.Namespace(load=str(checkpoint), ckpt_step=None, pretrained_checkpoint=None)
    vet_load_args(args)
    assert capsys.readouterr().err == ""  # a small checkpoint: nothing to announce
    monkeypatch.setattr(progress, "ANNOUNCE_BYTES", 1)
    vet_load_args(args)
    size = os.path.getsize(iteration / ".metadata") / 1e6
    assert capsys.readouterr().err == f"reading and vetting {iteration}/.metadata ({size:.0f} MB) ...\n"


def test_conversion_progress_in_a_log_is_plain_lines(checkpoint, tmp_path, capsys):
    rc, _, err = run_cli(capsys, ["convert", "to-hf", "--load", str(checkpoint), "--save", str(tmp_path / "hf")])
    assert rc == 0 and "\r" not in err and err.splitlines()[-1].startswith("to-hf hf: ") and err.endswith(" done\n")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`mixln-megatron arms | head -0`: the pipe is closed before the command writes (its imports
    take far longer than closing a file), so the write meets a broken pipe: no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "mixln_megatron.cli", "arms", "--num-layers", "24"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, 1), err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
