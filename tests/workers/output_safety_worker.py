"""Run one `mixln-megatron` command, pausing at a named point so a test can signal it there.

    python output_safety_worker.py POINT MARKER -- <mixln-megatron args>

POINT is where the process stops for up to 120 s after writing the file MARKER (its pid inside):
  read    the first read of a source tensor (the temporary output exists, no tensor written yet)
  write   after the third piece written (a partial safetensors / distcp / .bin file is open)
  rename  just before the finished temporary output is renamed into place
  none    no pause
The product code is not changed: the pause wraps functions from the outside, in this process only,
and everything else (signal handlers, cleanup, exit status) is the real command's.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def pause(marker: str) -> None:
    with open(marker + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.rename(marker + ".part", marker)  # the test sees the marker only once it is complete
    time.sleep(120)


def once(fn, marker, after=1):
    calls = [0]

    def wrapped(*a, **k):
        calls[0] += 1
        if calls[0] == after:
            pause(marker)
        return fn(*a, **k)

    return wrapped


def install(point: str, marker: str) -> None:
    import mixln_megatron.safe_output as so
    from mixln_megatron.convert import from_hf, gpt_hybrid, megatron_reader, to_hf, torch_dist_reader
    from mixln_megatron.data import preprocess as pp

    if point == "read":
        from_hf.HFCheckpoint.get = once(from_hf.HFCheckpoint.get, marker)
        for cls in [*vars(megatron_reader).values(), *vars(torch_dist_reader).values()]:
            if isinstance(cls, type) and "read_vocab_rows" in vars(cls):
                cls.read_vocab_rows = once(cls.read_vocab_rows, marker)
        pp.encode_chunk = once(pp.encode_chunk, marker)
    elif point == "write":
        for module in (to_hf, from_hf, gpt_hybrid):  # each conversion's progress bar
            def progress(*a, _make=module.progress_bar, **k):
                bar = _make(*a, **k)
                bar.update = once(bar.update, marker, after=3)
                return bar

            module.progress_bar = progress
        pp._add_document = once(pp._add_document, marker, after=3)
    elif point == "rename":
        real_rename, real_replace = so.os.rename, pp.os.replace

        def rename(src, dst, *a, **k):
            if os.path.basename(str(src)).startswith(f".{os.path.basename(str(dst))}.tmp-"):
                pause(marker)
            return real_rename(src, dst, *a, **k)

        def replace(src, dst, *a, **k):
            if str(dst).endswith(".idx"):
                pause(marker)  # the .bin is in place, the .idx not yet
            return real_replace(src, dst, *a, **k)

        so.os.rename = rename
        pp.os.replace = replace
    elif point != "none":
        raise SystemExit(f"unknown pause point {point!r}")


def main() -> int:
    point, marker, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: output_safety_worker.py POINT MARKER -- ARGS"
    install(point, marker)
    from mixln_megatron.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
