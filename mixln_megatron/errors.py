"""The project's user-facing errors, and how they reach the user: one line.

`MixLNError` is the base of every error that means "the user asked for something wrong or
unsupported" (a bad setting, an unsupported configuration, a refused conversion). Such an error
needs no traceback: the project's own commands print its message as one line and exit 2
(cli.main). Under stock Megatron-LM (pretrain_gpt.py / pretrain_hybrid.py with our `--spec`
objects) the edges Megatron-LM calls turn a refusal into `[mixln_megatron] ERROR: <message>` and
`Refusal`, a SystemExit(2): every rank leaves with exit status 2 and no traceback (`refuse`).

How the one line survives whichever rank fails first (`report`). Every rank that detects a
refusal takes part; nobody waits for a particular rank. The first local rank to detect it claims
the line for its node (an O_EXCL file in the node's temp directory, keyed by the launcher process
that started the local ranks, the rendezvous address and the message), prints it, then marks it
printed; a rank that finds the line claimed waits for that mark (or for the claimer's process to
be gone, when it prints the line itself) before it may leave. So the line is on stderr before any
rank of the node exits, and a launcher that stops the job at the first failed worker (torchrun's
SIGTERM) cannot cut it off. A job prints it once per node (identical text: `sort -u` merges the
nodes' copies); a process without a launcher (WORLD_SIZE unset or 1, or one rank per node)
prints without claiming. Any trouble with the claim file prints the line anyway: a duplicate
line, never a lost one.

Once per job (`alike_on_every_rank=True`): a refusal that depends only on the command line is met
by every rank of the job alike, so global rank 0 prints it and every other rank leaves quietly
with the same status. Rank 0's local peers still wait for its line (or for rank 0 to be gone,
when they print it themselves) before they leave, for the launcher's sake; ranks on other nodes
leave at once. A refusal that reads files (a checkpoint) stays once per node: a node may see
other files than rank 0's.

Dedup inside a process is per error, not a latch: `report` marks the exception it printed, and an
error whose chain (__cause__ / __context__, e.g. megatron's build_module re-raising it with its own
suffix) holds a printed one is not printed again. Another error still gets its line.

Pure Python: importing this module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import time
from typing import Iterator, NoReturn, Optional

PREFIX = "[mixln_megatron] ERROR:"
EXIT_STATUS = 2

# A rank that finds the line claimed waits for the claimer to print it; this bounds the wait only
# if the claimer can be neither seen printing nor seen gone (e.g. another PID namespace).
CLAIM_WAIT_BOUND_S = 600.0
_POLL_S = 0.02
_MARK = "_mixln_reported"


class MixLNError(Exception):
    """Base of the project's user-facing errors; the message says what was wrong and what to do."""


class MixLNConfigError(MixLNError, ValueError):
    """A Mix-LN setting is invalid; the message says which, where it came from and what to do."""


class Refusal(SystemExit):
    """A refusal leaving the process: exit status 2 and, being a SystemExit, no traceback.
    `error` is the refused error; str() is its one line (for code that catches BaseException)."""

    def __init__(self, error: BaseException):
        super().__init__(EXIT_STATUS)
        self.error = error

    def __str__(self) -> str:
        return one_line(self.error)


def one_line(error: BaseException) -> str:
    """The error's message on one line (a multi-line message is joined with ' | ')."""
    text = " | ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


def _chain(error: Optional[BaseException]) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def reported(error: BaseException) -> Optional[BaseException]:
    """The error in `error`'s chain whose line was printed (or given up to another rank), else None."""
    return next((e for e in _chain(error) if getattr(e, _MARK, False)), None)


def report(error: BaseException, file=None, *, alike_on_every_rank: bool = False) -> bool:
    """Print `[mixln_megatron] ERROR: <message>` unless this error (or one in its chain) was
    reported already; with several local ranks, once per node, or once per job with
    alike_on_every_rank (module docstring). Returns whether this process printed it."""
    if reported(error) is not None:
        return False
    try:
        setattr(error, _MARK, True)
    except AttributeError:  # an exception type with __slots__: nothing to mark, still print
        pass
    return print_once(f"{PREFIX} {one_line(error)}", file, alike_on_every_rank=alike_on_every_rank)


def print_once(line: str, file=None, *, alike_on_every_rank: bool = False) -> bool:
    """Print a refusal's line once per node, or once per job (on global rank 0) for a line every
    rank of the job prints alike; returns whether this process printed it."""
    role = _job_role() if alike_on_every_rank else None
    if role == "quiet" or (role == "wait" and not _rank_0_is_gone_without(line)):
        return False
    if role is None and not _claim_for_this_node(line):
        return False
    print(line, file=file or sys.stderr, flush=True)
    _mark_printed(line)
    if role is None:
        _mark_printed("")  # "a refusal was printed here": peers of rank 0 stop waiting even for another line
    return True


def refuse(error: BaseException) -> NoReturn:
    """Report the error in one line, then leave: Refusal, a SystemExit(2) with no traceback."""
    report(error)
    raise Refusal(reported(error) or error) from error


def in_megatron_lm_training() -> bool:
    """Whether Megatron-LM's training runtime is up (its global args are set): stock
    pretrain_gpt.py / pretrain_hybrid.py or the project's entry point. Imports nothing."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None) is not None


def refuse_in_training(error: BaseException) -> NoReturn:
    """For checks that run inside megatron-core calls (a checkpoint load): under Megatron-LM's
    training, `refuse` (one line, exit 2 on every rank; a SystemExit also passes Megatron-LM's
    `except Exception` retries); for a library caller (megatron-core users, the analysis tools),
    the line, then the error itself, which the caller may catch."""
    if in_megatron_lm_training():
        refuse(error)
    report(error)
    raise error


@contextlib.contextmanager
def refusals_leave():
    """At an edge stock Megatron-LM calls: a MixLNError raised inside leaves as `refuse` does."""
    try:
        yield
    except MixLNError as error:
        refuse(error)


# ------------------------------------------------------------------ once per node
def _local_ranks() -> int:
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return 2  # unreadable: assume company, claim
    return 1


def _launcher_identity() -> str:
    """The process that started this node's ranks (torchrun's agent, slurmstepd, ...), with its
    start time so a reused PID is another launcher."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = ""
    return f"{ppid}:{started}"


def _paths(line: str):
    key = "\0".join([_launcher_identity(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                     os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", ""),
                     line])
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    folder = os.path.join(tempfile.gettempdir(), f"mixln_megatron-errors-{os.getuid()}")
    return folder, os.path.join(folder, name + ".claim"), os.path.join(folder, name + ".printed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, not ours to signal
    return True


def _claim_for_this_node(line: str) -> bool:
    """True when this process is to print the line: alone, the node's first, or the claimer is gone."""
    if _local_ranks() <= 1:
        return True
    try:
        folder, claim, printed = _paths(line)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return _wait_for_claimer(claim, printed)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        _prune(folder)
        return True
    except OSError:
        return True  # no claim possible: print (a duplicate, never a lost line)


def _wait_for_claimer(claim: str, printed: str) -> bool:
    deadline = time.monotonic() + CLAIM_WAIT_BOUND_S
    while time.monotonic() < deadline:
        if os.path.exists(printed):
            return False
        try:
            with open(claim) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text.isdigit() and not _alive(int(text)) and not os.path.exists(printed):
            return True  # the claimer died before printing: print it here
        time.sleep(_POLL_S)
    return True


# ------------------------------------------------------------------ once per job
def _job_role() -> Optional[str]:
    """For a line every rank prints alike: None (print it as once per node: rank 0, a process
    alone, or a layout this cannot tell), "wait" (a peer of rank 0 on its node) or "quiet"
    (a rank on another node). Launchers number a node's ranks from RANK - LOCAL_RANK on."""
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        return None
    if rank == 0:
        return None
    return "wait" if rank - local_rank == 0 else "quiet"


def _rank_0_is_gone_without(line: str) -> bool:
    """A peer of rank 0 waits for rank 0 to print `line` (False), or for a sign that it never
    will: rank 0 gone without it, or rank 0 printed another refusal (True: print it here)."""
    try:
        _, claim, printed = _paths(line)
        any_printed = _paths("")[2]
    except OSError:
        return True
    deadline = time.monotonic() + CLAIM_WAIT_BOUND_S
    while time.monotonic() < deadline:
        if os.path.exists(printed):
            return False
        if os.path.exists(any_printed):  # marked after the line's own mark: look at that once more
            return not os.path.exists(printed)
        try:
            with open(claim) as f:
                text = f.read().strip()
        except OSError:
            text = ""  # rank 0 has not got there yet
        if text.isdigit() and not _alive(int(text)) and not os.path.exists(printed):
            return True
        time.sleep(_POLL_S)
    return True


def _mark_printed(line: str) -> None:
    if _local_ranks() <= 1:
        return
    try:
        _, _, printed = _paths(line)
        os.close(os.open(printed, os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError:
        pass


def _prune(folder: str, age_s: float = 86400.0) -> None:
    """Remove this module's claim files older than a day (only *.claim / *.printed it wrote)."""
    now = time.time()
    try:
        for entry in os.scandir(folder):
            if entry.name.endswith((".claim", ".printed")) and now - entry.stat().st_mtime > age_s:
                os.unlink(entry.path)
    except OSError:
        pass


class ConversionError(MixLNError, RuntimeError):
    """A checkpoint or model folder cannot be read or converted; the message says why and what to do."""


class UnsupportedModelError(ConversionError):
    """The checkpoint's model uses a feature the conversion (or Llama) cannot express."""


class UnsafeCheckpointError(ConversionError):
    """A checkpoint file names a global that is not on the allow-list, or is not a readable pickle."""


class UnsafeInputError(ConversionError):
    """A file an input names lies outside the input, is not a regular file, or exceeds its size bound."""
