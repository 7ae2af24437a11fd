"""Nothing a user does may lose a checkpoint or leave partial output.

Refusals: an output that equals, contains or lies inside the input (symlinks and `..` resolved) and
--overwrite over anything but a previous export of the same direction are refused before any work,
by the real command (one line, exit 2), with the input byte-for-byte unchanged.

Killed runs: the real command runs as a subprocess (tests/workers/output_safety_worker.py pauses it
at a named point so the signal lands there: first source read, mid-write, just before the rename)
on the tiny Llama of test_convert (fp32), and gets a real SIGTERM, SIGHUP or SIGKILL. The pause
points are fixed calls (the first read, the third piece written, the rename of the finished output)
and the test waits for the marker the paused process writes, so the model's size decides nothing:
the tiny model has the pieces a big one has (embedding, 4 GQA layers, final norm, untied output,
one safetensors file).
Then: no output folder and no .bin/.idx pair, the source unchanged; SIGTERM/SIGHUP clean up and say
so in one line; after SIGKILL the next run removes the stale temporaries, says so, and succeeds.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")

from test_convert import make_llama_folder, no_leftovers, tensors  # noqa: E402

from harness.testing import run_python, start_python
from mixln_megatron.convert import ConversionError, convert_from_hf, convert_to_hf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "workers", "output_safety_worker.py")


def tree_hash(path) -> str:
    """sha256 over every file's relative path and bytes (the source must not change at all)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(str(path)):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, str(path)).encode())
            with open(full, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def cli(*args):
    return run_python([sys.executable, "-m", "mixln_megatron.cli", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The tiny fp32 HF folder and the Megatron checkpoint from-hf makes of it, with their hashes."""
    root = tmp_path_factory.mktemp("sources")
    make_llama_folder(root / "hf", dtype=torch.float32)
    convert_from_hf(str(root / "hf"), str(root / "mg"), progress=False)
    return {"hf": root / "hf", "mg": root / "mg", "hash": {k: tree_hash(root / k) for k in ("hf", "mg")}}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The tiny HF folder of test_convert (for tests that need no size)."""
    path = tmp_path_factory.mktemp("small") / "hf"
    make_llama_folder(path)
    return path


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("where", ["same", "parent", "inside", "symlink", "dotdot"])
def test_output_overlapping_the_input_is_refused_before_any_work(tmp_path, small, where):
    proj = tmp_path / "proj"
    convert_from_hf(str(small), str(proj / "ckpt"), progress=False)  # the project folder holds the checkpoint
    (proj / "notes.txt").write_text("mine")
    load = {"same": proj, "parent": proj / "ckpt", "inside": proj, "symlink": proj, "dotdot": proj / "ckpt"}[where]
    save = {"same": proj, "parent": proj, "inside": proj / "ckpt" / "hf", "symlink": tmp_path / "link",
            "dotdot": proj / "ckpt" / ".." / "ckpt"}[where]
    if where == "symlink":
        os.symlink(proj, save)
    before = tree_hash(proj)
    if where == "parent":  # the reported case, through the real command: one line, exit 2
        r = cli("convert", "to-hf", "--load", load, "--save", save, "--overwrite", "--no-progress")
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        message = lines[0]
    else:
        with pytest.raises(ConversionError) as e:
            convert_to_hf(str(load), str(save), overwrite=True, progress=False)
        message = str(e.value)
    assert f"output {save}" in message and f"input {load}" in message and "delete the input" in message
    assert tree_hash(proj) == before
    # the same check guards from-hf
    with pytest.raises(ConversionError, match="delete the input"):
        convert_from_hf(str(small), str(small / "mg"), overwrite=True, progress=False)


def test_overwrite_replaces_only_a_previous_export_of_the_same_direction(tmp_path, sources, capsys):
    foreign = tmp_path / "runs"
    foreign.mkdir()
    for name in ("config.json", "model.safetensors", "train.log", "wandb", "eval.jsonl"):
        (foreign / name).write_text("x")
    before = tree_hash(foreign)
    r = cli("convert", "to-hf", "--load", sources["mg"], "--save", foreign, "--overwrite", "--no-progress")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "eval.jsonl, train.log, wandb" in r.stderr and "not one" in r.stderr
    assert tree_hash(foreign) == before and not no_leftovers(foreign)

    # an HF export is not a Megatron export: from-hf --overwrite refuses it (and the reverse)
    hf_out, mg_out = tmp_path / "hf_out", tmp_path / "mg_out"
    convert_to_hf(str(sources["mg"]), str(hf_out), progress=False)
    convert_from_hf(str(sources["hf"]), str(mg_out), progress=False)
    with pytest.raises(ConversionError, match="not one: it holds config.json"):
        convert_from_hf(str(sources["hf"]), str(hf_out), overwrite=True, progress=False)
    with pytest.raises(ConversionError, match="holds latest_checkpointed_iteration.txt, release"):
        convert_to_hf(str(sources["mg"]), str(mg_out), overwrite=True, progress=False)

    # a previous export of the same direction is replaced, old removed, no temporaries left
    (hf_out / "model.safetensors").write_bytes(b"stale")  # an old export's file the new one does not write
    convert_to_hf(str(sources["mg"]), str(hf_out), overwrite=True, progress=False)
    assert not (hf_out / "model.safetensors").exists() and not no_leftovers(hf_out)
    convert_from_hf(str(sources["hf"]), str(mg_out), overwrite=True, progress=False)
    assert not no_leftovers(mg_out)
    assert (tree_hash(sources["hf"]), tree_hash(sources["mg"])) == (sources["hash"]["hf"], sources["hash"]["mg"])


def test_old_output_is_back_when_the_replacement_fails(tmp_path, sources, monkeypatch):
    """A failure between moving the old output aside and renaming the new one in puts the old back."""
    import mixln_megatron.safe_output as so

    out = tmp_path / "hf_out"
    convert_to_hf(str(sources["mg"]), str(out), progress=False)
    old = tree_hash(out)
    real = os.rename

    def failing(src, dst):
        if os.path.basename(str(src)).startswith(".hf_out.tmp-"):
            raise OSError("rename failed (simulated)")
        return real(src, dst)

    monkeypatch.setattr(so.os, "rename", failing)
    with pytest.raises(OSError, match="simulated"):
        convert_to_hf(str(sources["mg"]), str(out), overwrite=True, progress=False)
    monkeypatch.undo()
    assert tree_hash(out) == old and not no_leftovers(out)


@pytest.mark.parametrize("existing", ["empty", "previous export"])
def test_save_given_as_a_symlink_writes_through_it_and_leaves_nothing_beside(tmp_path, sources, existing):
    """--save as a link to a folder elsewhere (a scratch disk): the export lands in that folder, the
    link stays a link, and no `.<name>.old-*` / `.tmp-*` entry is left beside either."""
    target = tmp_path / "scratch" / "export"
    target.mkdir(parents=True)
    if existing == "previous export":
        convert_to_hf(str(sources["mg"]), str(target), overwrite=True, progress=False)
    link = tmp_path / "work" / "out"
    link.parent.mkdir()
    os.symlink(target, link)
    r = cli("convert", "to-hf", "--load", sources["mg"], "--save", link, "--overwrite", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert os.path.islink(link) and os.path.realpath(link) == str(target)
    assert (target / "config.json").is_file()
    assert sorted(os.listdir(link.parent)) == ["out"]
    assert sorted(os.listdir(target.parent)) == ["export"]
    assert tree_hash(sources["mg"]) == sources["hash"]["mg"]


# ----------------------------------------------------------------------------------------- real signals
def start(tmp_path, point, *args):
    marker = tmp_path / f"paused-{point}"
    proc = start_python([sys.executable, WORKER, point, str(marker), "--", *map(str, args)], cwd=REPO)
    deadline = time.time() + 600
    while not marker.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the command ended (rc {proc.returncode}) before reaching {point}:\n{err[-3000:]}")
        assert time.time() < deadline, f"no pause at {point}"
        time.sleep(0.02)
    return proc


def signal_and_wait(proc, sig):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, err


def temporaries(out):
    return sorted(no_leftovers(out))


def signal_id(v):
    return v.name if isinstance(v, signal.Signals) else v


CASES = [  # direction, point, signal (the full grid runs with the slow tests)
    ("to-hf", "read", signal.SIGTERM), ("to-hf", "write", signal.SIGKILL), ("to-hf", "write", signal.SIGHUP),
    ("from-hf", "write", signal.SIGTERM), ("from-hf", "rename", signal.SIGKILL),
    ("gpt-to-hybrid", "write", signal.SIGTERM), ("gpt-to-hybrid", "rename", signal.SIGKILL),
]
SLOW_CASES = [("to-hf", "read", signal.SIGKILL), ("to-hf", "rename", signal.SIGKILL), ("to-hf", "rename", signal.SIGTERM),
              ("from-hf", "read", signal.SIGTERM), ("from-hf", "read", signal.SIGKILL),
              ("from-hf", "rename", signal.SIGTERM), ("from-hf", "write", signal.SIGKILL)]


@pytest.mark.parametrize("direction,point,sig", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=signal_id)
def test_killed_conversion_leaves_nothing_and_next_run_cleans_up(tmp_path, sources, direction, point, sig, capfd):
    from mixln_megatron.convert.gpt_hybrid import convert_gpt_to_hybrid

    source = "hf" if direction == "from-hf" else "mg"
    src = sources[source]
    out = tmp_path / "out"
    proc = start(tmp_path, point, "convert", direction, "--load", src, "--save", out, "--no-progress")
    left = temporaries(out)
    assert len(left) == 1 and left[0].startswith(".out.tmp-"), left  # the paused run is writing here
    rc, err = signal_and_wait(proc, sig)
    assert not out.exists()
    assert tree_hash(src) == sources["hash"][source]
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL and temporaries(out) == left  # nothing could clean up
    else:
        assert rc == 128 + sig, err
        lines = err.strip().splitlines()
        assert lines == [f"mixln-megatron convert {direction}: stopped by {sig.name}: the temporary output was "
                         f"removed; {out} is as it was before this run"], err
        assert temporaries(out) == []
    capfd.readouterr()
    run = {"to-hf": convert_to_hf, "from-hf": convert_from_hf, "gpt-to-hybrid": convert_gpt_to_hybrid}[direction]
    run(str(src), str(out), progress=False)
    said = [line for line in capfd.readouterr().err.splitlines() if "stale" in line]
    if sig == signal.SIGKILL:
        assert said == [f"[mixln_megatron] out: removed 1 stale temporary entry of an interrupted run ({left[0]}) "
                        f"in {tmp_path}"], said
    else:
        assert said == []
    assert temporaries(out) == [] and (out / ("config.json" if direction == "to-hf" else
                                              "latest_checkpointed_iteration.txt")).exists()


def test_killed_replacement_keeps_the_old_export(tmp_path, sources, capfd):
    """SIGKILL after the old export was moved aside, before the new one was renamed in: the next run
    puts the old one back (so a run without --overwrite is refused), and --overwrite then succeeds."""
    out = tmp_path / "hf_out"
    convert_to_hf(str(sources["mg"]), str(out), progress=False)
    old = tree_hash(out)
    proc = start(tmp_path, "rename", "convert", "to-hf", "--load", sources["mg"], "--save", out, "--overwrite",
                 "--no-progress")
    rc, _ = signal_and_wait(proc, signal.SIGKILL)
    assert rc == -signal.SIGKILL and not out.exists()
    assert sorted(n.split("-")[0] for n in temporaries(out)) == [".hf_out.old", ".hf_out.tmp"]
    capfd.readouterr()
    with pytest.raises(ConversionError, match="not empty"):
        convert_to_hf(str(sources["mg"]), str(out), progress=False)
    assert "restored the previous output" in capfd.readouterr().err
    assert tree_hash(out) == old and temporaries(out) == []
    convert_to_hf(str(sources["mg"]), str(out), overwrite=True, progress=False)
    assert tree_hash(out) == old and temporaries(out) == []  # same source, same export, old one gone


def test_sweep_leaves_temporaries_of_live_processes(tmp_path, sources, capfd):
    """A temporary whose recorded process is alive (another conversion into the same output) stays."""
    out = tmp_path / "out"
    proc = start(tmp_path, "write", "convert", "to-hf", "--load", sources["mg"], "--save", out, "--no-progress")
    try:
        left = temporaries(out)
        capfd.readouterr()
        convert_to_hf(str(sources["mg"]), str(out), progress=False)  # a second run into the same output
        assert f"left {left[0]} (pid {proc.pid} is running)" in capfd.readouterr().err
        assert temporaries(out) == left
    finally:
        rc, _ = signal_and_wait(proc, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM and temporaries(out) == []


# ----------------------------------------------------------------------------------------- preprocess
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n\n".join(f"Paragraph {i} of a small corpus, with some words." for i in range(200)))
    return path


@pytest.mark.parametrize("point,sig", [("rename", signal.SIGKILL)] + [
    pytest.param(*c, marks=pytest.mark.slow)
    for c in (("write", signal.SIGTERM), ("write", signal.SIGKILL), ("read", signal.SIGHUP))], ids=signal_id)
def test_killed_preprocess_leaves_no_pair_and_next_run_cleans_up(tmp_path, corpus, point, sig, capfd):
    from mixln_megatron.data import preprocess as pp

    prefix = tmp_path / "data"
    before = tree_hash(corpus.parent)
    proc = start(tmp_path, point, "preprocess", "-i", corpus, "-o", prefix, "--no-progress")
    rc, err = signal_and_wait(proc, sig)
    pair = [os.path.exists(str(prefix) + ext) for ext in (".bin", ".idx")]
    assert pair != [True, True] and not pair[1]  # at most the lone .bin of a run killed between renames
    assert tree_hash(corpus.parent) == before
    stale = sorted(n for n in os.listdir(tmp_path) if n.startswith(".data.tmp-"))
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL and stale
    else:
        assert rc == 128 + sig and err.strip().splitlines()[-1] == f"stopped by {sig.name}: nothing written"
        assert not stale and pair == [False, False]
    capfd.readouterr()
    pp.preprocess_files([str(corpus)], str(prefix), progress=False)
    err = capfd.readouterr().err
    assert ("removed" in err and "stale" in err) == (sig == signal.SIGKILL), err
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".data.")]
    assert os.path.exists(str(prefix) + ".bin") and os.path.exists(str(prefix) + ".idx")


def test_preprocess_refuses_to_write_over_its_input(tmp_path, corpus, capsys):
    from mixln_megatron.data import preprocess as pp

    victim = tmp_path / "data.bin"
    victim.write_bytes(corpus.read_bytes())
    before = tree_hash(tmp_path)
    assert pp.main(["-i", str(victim), "-o", str(tmp_path / "data"), "--overwrite", "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "delete the input" in err[0] and str(victim) in err[0], err
    assert tree_hash(tmp_path) == before


@pytest.mark.slow
def test_hf_export_from_killed_and_rerun_is_the_same_model(tmp_path, sources):
    """The export that follows a killed run is complete: tensors equal the original HF folder's."""
    out = tmp_path / "out"
    proc = start(tmp_path, "write", "convert", "to-hf", "--load", sources["mg"], "--save", out, "--no-progress")
    signal_and_wait(proc, signal.SIGKILL)
    convert_to_hf(str(sources["mg"]), str(out), progress=False)
    a, b = tensors(out), tensors(sources["hf"])
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
