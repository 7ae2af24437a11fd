"""Run `python ...` and single-node torchrun commands as children of one process that has already
imported torch and megatron-core: the test suite's stand-in for fresh interpreters.

Each fresh interpreter spends ~10 CPU-seconds importing torch and megatron-core (torch._inductor
comes with megatron.core's fusions) before a tiny worker does a second of work, and the test suite
starts well over a hundred. Python's own `forkserver` start method, with those modules preloaded,
starts one server process that imports them once and forks every rank from there. Each rank then runs its script as `python script`
would (`runpy`, `sys.argv`, the job's environment, its working directory, atexit handlers), with
torchrun's variables and a rendezvous store that this launcher hosts, as torchrun's agent does
(`TORCHELASTIC_USE_AGENT_STORE`): no free-port race. As torchrun does, the first rank to fail
gets the others a SIGTERM.

What differs from fresh interpreters, so tests of the launcher's or the import's own behaviour
keep them: the ranks' parent is the fork server, torchrun's failure summary is not printed, and
the preloaded modules (torch._dynamo among them) were imported under the server's environment,
not the job's (a job whose PYTHONPATH drops an entry or adds one that holds a module the server
imported, or a command other than `python` and single-node torchrun, runs as given).
Development only: nothing in training, conversion or analysis uses it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import types
from typing import List, Optional, Sequence

# What every worker imports first; a module missing from a release is skipped by the server.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.transformer",
    "megatron.core.dist_checkpointing",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
)
# Variables whose value changes what an import does: a job that sets one runs in fresh interpreters.
IMPORT_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH")

_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


def _run_rank(kind: str, target: str, argv: Sequence[str], env: dict, cwd: str, out: str, err: str) -> None:
    """One rank, in a child of the fork server, as `python <target> argv...` would run it."""
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _startup_warning_filters(env.get("PYTHONWARNINGS", ""))
    # PYTHONPATH entries come right after the script's folder, as in a fresh interpreter
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if "OMP_NUM_THREADS" in env:  # torchrun's 1 per rank; the preloaded torch has not sized its pool yet
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if kind == "module":  # python -m: the working directory first on sys.path
            sys.argv = [target, *argv]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "code":  # python -c: '' first on sys.path, the code runs in a module named __main__
            sys.argv = ["-c", *argv]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *argv]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a child of multiprocessing leaves through os._exit: run them as python would
        sys.stdout.flush()
        sys.stderr.flush()


def _startup_warning_filters(pythonwarnings: str) -> None:
    """The warning filters a fresh interpreter starts with under this PYTHONWARNINGS (the server's
    were made from its own environment): the built-in defaults, then the options in front."""
    import warnings

    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__", append=True)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category, append=True)
    options = [option for option in pythonwarnings.split(",") if option]
    sys.warnoptions[:] = options
    warnings._processoptions(options)


def _parse(command: Sequence[str]):
    """(nproc or None for a plain process, kind, target, argv) of a `python ...` or
    `python -m torch.distributed.run --standalone --nproc_per_node=N ...` command; None when it is
    anything else (then it runs as given)."""
    command = [str(c) for c in command]
    if len(command) < 2 or command[0] != sys.executable:
        return None
    rest = command[1:]
    nproc = None
    if rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:]
        while rest and rest[0].startswith("--"):
            flag = rest.pop(0)
            if flag == "--standalone" or flag in ("--nnodes=1", "--nnodes=1:1"):
                continue
            name, _, value = flag.partition("=")
            if name not in ("--nproc_per_node", "--nproc-per-node"):
                return None
            if not value:
                if not rest:
                    return None
                value = rest.pop(0)
            if not value.isdigit():
                return None
            nproc = int(value)
        if nproc is None:
            return None
    if not rest:
        return None
    if rest[0] in ("-m", "-c"):
        if len(rest) < 2 or (nproc is not None and rest[0] == "-c"):
            return None
        return nproc, "module" if rest[0] == "-m" else "code", rest[1], rest[2:]
    if rest[0].startswith("-"):
        return None
    return nproc, "path", rest[0], rest[1:]


def _imports_differ(env: dict) -> bool:
    """Whether `env` would make an import resolve otherwise than in the fork server (whose sys.path
    is this process's): a loader variable, a PYTHONPATH that drops an entry, or one that adds an
    entry holding a top-level name the server has imported (a package of its own, e.g. another
    megatron tree). An added entry with only other names (a folder of test modules) changes nothing
    that was imported: the child puts it on sys.path as a fresh interpreter would."""
    for name in IMPORT_VARIABLES:
        if name == "PYTHONPATH":
            known = {os.path.realpath(p or ".") for p in sys.path}
            wanted = {os.path.realpath(p) for p in env.get(name, "").split(os.pathsep) if p}
            now = {os.path.realpath(p) for p in os.environ.get(name, "").split(os.pathsep) if p}
            if not now <= wanted or any(_shadows_the_server(p) for p in wanted - known):
                return True
        elif env.get(name) != os.environ.get(name):
            return True
    return False


_server_names: Optional[frozenset] = None
# what a fresh interpreter's `site` imports from sys.path at startup, PYTHONPATH's entries included
STARTUP_MODULES = frozenset({"sitecustomize", "usercustomize"})


def _shadows_the_server(entry: str) -> bool:
    """Whether a sys.path entry holds a module or package named like one the fork server imported
    (asked once of a forked child); anything but a readable folder counts as shadowing."""
    global _server_names
    if not os.path.exists(entry):
        return False  # a fresh interpreter skips it too
    if not os.path.isdir(entry):
        return True  # a zip archive: not looked into
    if _server_names is None:
        receive, send = _server().Pipe(duplex=False)
        child = _server().Process(target=_send_names, args=(send,), name="names")
        child.start()
        send.close()
        _server_names = receive.recv()
        child.join()
    try:
        names = {item.partition(".")[0] for item in os.listdir(entry)}
    except OSError:
        return True
    return bool(names & (_server_names | STARTUP_MODULES))


def _send_names(connection) -> None:
    connection.send(frozenset(name.partition(".")[0] for name in sys.modules))
    connection.close()


class Started:
    """A started command, with the part of subprocess.Popen's interface the tests use: pid (the
    first rank's), poll, wait, communicate, send_signal, terminate, kill, returncode, args; and
    what torchrun's failure summary would name: `first_failure` (the exit status of the first rank
    to fail, its Root Cause) and `exit_statuses` (each rank's, by rank; -N for a signal)."""

    def __init__(self, command, ranks, logs, merged: bool, torchrun: bool, store):
        self.args, self._ranks, self._logs, self._merged, self._torchrun = command, ranks, logs, merged, torchrun
        self._store = store  # the rendezvous store lives as long as the ranks
        self.pid = ranks[0].pid
        self.returncode = None
        self._first_failure = 0
        self._pending = {proc.sentinel: proc for proc in ranks}

    @property
    def first_failure(self) -> int:
        return self._first_failure

    @property
    def exit_statuses(self) -> List[Optional[int]]:
        return [rank.exitcode for rank in self._ranks]

    def _reap(self, timeout):
        """Reap what has ended within `timeout` (None: all); True when every rank has ended. The
        first rank to fail gets the rest a SIGTERM, as torchrun does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(list(self._pending), timeout=left)
            if not ready:
                return False
            for sentinel in ready:
                proc = self._pending.pop(sentinel)
                proc.join()
                if proc.exitcode and not self._first_failure:
                    self._first_failure = proc.exitcode
                    for other in self._pending.values():
                        other.terminate()
        code = self._first_failure
        self.returncode = 1 if (self._torchrun and code) else code  # torchrun's own status on a failure
        self._store = None
        return True

    def poll(self):
        self._reap(0)
        return self.returncode

    def wait(self, timeout=None):
        if not self._reap(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        stdout = "".join(_read(os.path.join(self._logs.name, f"{r}.out")) for r in range(len(self._ranks)))
        stderr = "".join(_read(os.path.join(self._logs.name, f"{r}.err")) for r in range(len(self._ranks)))
        self._logs.cleanup()
        return (stdout, None) if self._merged else (stdout, stderr)

    def send_signal(self, sig):
        for proc in self._ranks:
            if proc.exitcode is None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def start(command: Sequence, *, env: Optional[dict] = None, cwd=None, merge_stderr: bool = False):
    """subprocess.Popen(command, stdout=PIPE, stderr=PIPE or STDOUT, text=True) for a `python ...`
    or single-node torchrun command, as children of the fork server; None for any other command,
    or an environment that changes what an import does (the caller then starts it as given)."""
    env = dict(os.environ if env is None else env)
    parsed = _parse(command)
    if parsed is None or _imports_differ(env):
        return None
    nproc, kind, target, argv = parsed
    store = None
    if nproc is not None:
        import torch.distributed

        # hosted here, as torchrun's agent hosts it: the OS picks the port, nobody races for it
        store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default",
                   ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                   TORCHELASTIC_RUN_ID=f"forked-{os.getpid()}-{time.monotonic_ns()}")
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
    ctx = _server()
    logs = tempfile.TemporaryDirectory(prefix="mixln_ranks_")
    ranks: List[multiprocessing.Process] = []
    for rank in range(nproc or 1):
        rank_env = dict(env)
        if nproc is not None:
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        out = os.path.join(logs.name, f"{rank}.out")
        err = out if merge_stderr else os.path.join(logs.name, f"{rank}.err")
        proc = ctx.Process(target=_run_rank, args=(kind, target, argv, rank_env, str(cwd or os.getcwd()), out, err),
                           name=f"rank{rank}")
        proc.start()
        ranks.append(proc)
    return Started(list(map(str, command)), ranks, logs, merge_stderr, nproc is not None, store)


def run(command: Sequence, *, env: Optional[dict] = None, cwd=None, timeout: Optional[float] = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, ...), through `start` where it can."""
    started = start(command, env=env, cwd=cwd)
    if started is None:
        return subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd, check=check)
    stdout, stderr = started.communicate(timeout=timeout)
    result = subprocess.CompletedProcess(started.args, started.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
