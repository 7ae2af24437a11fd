"""The project's user-facing errors, and how they reach the user: one line, exit 2, no traceback
(what the user sees: docs/commands.md#errors-and-exit-status). The commands print a MixLNError
through cli_parsing.refused; the edges stock Megatron-LM calls `refuse`: the line
`[mixln_megatron] ERROR: <message>`, then `Refusal`, a SystemExit(2), on every rank.

How the line survives whichever rank fails first (`report`): with several local ranks, the first
to detect the refusal claims the line for its node (a `NodeClaim`), prints it, then marks it
printed; a rank that finds it claimed waits for that mark (or prints it itself once the claimer
is gone) before it may leave, so a launcher that stops the job at the first failed worker
(torchrun's SIGTERM) cannot cut it off. Any trouble with the claim prints the line anyway: a
duplicate line, never a lost one. With `alike_on_every_rank=True` (a refusal that depends only on
the command line) global rank 0 prints it, its local peers wait for it, other nodes leave at
once; a refusal that reads files stays once per node (a node may see other files than rank 0).

Within a process an error is printed once: `report` marks it, and an error whose chain
(__cause__ / __context__, e.g. megatron's build_module re-raising it) holds a printed one is not
printed again; another error still gets its line.

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


# ------------------------------------------------------------------ one process of a node
def _local_ranks() -> int:
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return 2  # unreadable: assume company, claim
    return 1


def process_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks (Linux), so that a reused pid is another process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: int, start: Optional[str] = None) -> bool:
    """Whether process `pid` runs (and, given its `start`, is still that process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, not ours to signal
    now = process_start(pid) if start is not None else None
    return start is None or now is None or now == start


class NodeClaim:
    """Which local rank of a node does a job once: printing a refusal's line (here), vetting a
    checkpoint (convert.vet). The first rank to create the claim file (O_EXCL, holding its pid, in
    the node's temp directory) does the job; the others wait for its result (`wait`). The claim is
    keyed by the launcher process that started the node's ranks (with its start time), the
    rendezvous, the run and restart, and the job's subject, so another job never shares it."""

    SUFFIXES = (".claim", ".printed", ".verdict")

    def __init__(self, kind: str, subject: str):
        ppid = os.getppid()
        key = "\0".join([f"{ppid}:{process_start(ppid) or ''}", os.environ.get("MASTER_ADDR", ""),
                         os.environ.get("MASTER_PORT", ""), os.environ.get("TORCHELASTIC_RUN_ID", ""),
                         os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), subject])
        self.folder = os.path.join(tempfile.gettempdir(), f"mixln_megatron-{kind}-{os.getuid()}")
        self.name = hashlib.sha256(key.encode()).hexdigest()[:32]
        self.claim = self.path(".claim")

    def path(self, suffix: str) -> str:
        """A file of this claim (its result: `.printed`, `.verdict`)."""
        return os.path.join(self.folder, self.name + suffix)

    def take(self) -> bool:
        """True when this process claimed the job, False when another one had (OSError: no claim possible)."""
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        try:
            fd = os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        self._prune()
        return True

    def wait(self, done, bound_s: Optional[float] = None) -> bool:
        """Wait until done() (True), or until the claimer is gone without it or `bound_s` passed (False)."""
        deadline = None if bound_s is None else time.monotonic() + bound_s
        while deadline is None or time.monotonic() < deadline:
            if done():
                return True
            try:
                with open(self.claim) as f:
                    text = f.read().strip()
            except OSError:
                text = ""  # the claimer has not written it yet
            if text.isdigit() and not process_alive(int(text)):
                return done()  # gone: look once more, it may have finished just before
            time.sleep(_POLL_S)
        return False

    def _prune(self, age_s: float = 86400.0) -> None:
        """Remove this kind's claim files older than a day (only the files claims write)."""
        now = time.time()
        try:
            for entry in os.scandir(self.folder):
                if entry.name.endswith(self.SUFFIXES) and now - entry.stat().st_mtime > age_s:
                    os.unlink(entry.path)
        except OSError:
            pass


def _claim_for_this_node(line: str) -> bool:
    """True when this process is to print the line: alone, the node's first, or the claimer is gone."""
    if _local_ranks() <= 1:
        return True
    try:
        claim = NodeClaim("errors", line)
        if claim.take():
            return True
        printed = claim.path(".printed")
        return not claim.wait(lambda: os.path.exists(printed), CLAIM_WAIT_BOUND_S)
    except OSError:
        return True  # no claim possible: print (a duplicate, never a lost line)


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
        claim = NodeClaim("errors", line)
        printed, any_printed = claim.path(".printed"), NodeClaim("errors", "").path(".printed")
    except OSError:
        return True
    claim.wait(lambda: os.path.exists(printed) or os.path.exists(any_printed), CLAIM_WAIT_BOUND_S)
    return not os.path.exists(printed)


def _mark_printed(line: str) -> None:
    if _local_ranks() <= 1:
        return
    try:
        os.close(os.open(NodeClaim("errors", line).path(".printed"), os.O_CREAT | os.O_WRONLY, 0o600))
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
