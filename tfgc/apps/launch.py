"""Local multi-worker launcher: ``tfgc-launch --workers N -- python train.py ...``.

Starts N copies of a command on this machine, each with its own ``TF_CONFIG``
so that ``tf.distribute.MultiWorkerMirroredStrategy`` (and our subclass) can
form a cluster over localhost.  The launcher's main job beyond spawning is
failure handling: in a collective-based cluster a single dead worker leaves
its peers blocked forever inside an all-reduce, so the launcher must notice
the first failure, tear the whole cluster down (escalating to SIGKILL), and
tell the user which worker died and why.

With ``--restarts N`` (``launch(..., restarts=N)``; default 0) a worker
failure, i.e. a non-zero exit or death by a signal, does not end the run at
once: after the cluster has been torn down and the failure reported, ALL
workers are started again, on fresh free ports with a fresh ``TF_CONFIG``
(a TF cluster cannot take one worker back on its own), up to N times.  Each
worker sees ``TFGC_RESTART_COUNT`` (0 on the first start, 1 after the first
restart, ...).  When no restarts are left, the run fails as it would without
them.  ``--timeout`` bounds the whole run, restarts included.  SIGINT/SIGTERM
to the launcher never cause a restart, and neither does a command that
cannot be started at all.

The launcher itself deliberately uses only the standard library (argparse, not
absl; no TensorFlow import) so that it starts instantly and cannot be broken
by the code it launches.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import numbers
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Iterable, Mapping, Sequence

__all__ = [
    "LaunchResult",
    "launch",
    "main",
    "pick_free_ports",
    "build_tf_config",
    "TAIL_LINES",
]

PROG = "tfgc-launch"

# TensorFlow's native start-up lines, which its own log-level settings do not silence
# (glog-style INFO and WARNING lines, the absl pre-initialisation notice, the CPU
# feature hint, the CUDA probe of a CPU-only host). Hidden from the console unless asked
# for (--tf-logs, tfgc-train --tf_logs); a failing worker's report still shows its tail.
_TF_NOISE = re.compile(
    r"^([IW]\d{4} [\d:.]+ +\d+ \S+:\d+\]"
    r"|WARNING: All log messages before absl::InitializeLog"
    r"|To enable the following instructions:"
    r"|E\d{4} \S+ +\d+ cuda_(platform|executor)\.cc:\d+\] failed call to cuInit)")


def is_tensorflow_noise(line: str) -> bool:
    """Whether ``line`` is one of TensorFlow's native start-up lines (see ``_TF_NOISE``)."""
    return bool(_TF_NOISE.match(line))


def collapse_progress(line: str) -> str:
    """The last state of a line that a progress bar redrew in place.

    Keras 3's progress bar redraws with backspaces and carriage returns whatever its
    output is, so a pipe receives one line per epoch holding every redraw (thousands
    of characters). What a terminal would show at the end is what follows the last
    carriage return that is followed by text, without the backspaces.
    """
    if "\r" not in line and "\b" not in line:
        return line
    end = "\n" if line.endswith("\n") else ""
    parts = [p.replace("\b", "") for p in line.rstrip("\n").split("\r")]
    shown = [p for p in parts if p.strip()]
    return (shown[-1].rstrip() if shown else "") + end


# How many trailing output lines of a failed worker are shown in the report.
TAIL_LINES = 20
# Main-loop polling period.  Small enough that failures are noticed promptly,
# large enough to cost nothing measurable.
_POLL_S = 0.05
# Exit code used for --timeout, mirroring coreutils timeout(1).
TIMEOUT_EXIT_CODE = 124
# Exit code when a worker could not even be started (like a shell's 127).
SPAWN_FAILURE_EXIT_CODE = 127


@dataclasses.dataclass
class LaunchResult:
    """Outcome of :func:`launch`.

    ``returncode`` is what the ``tfgc-launch`` process exits with: 0 when all
    workers exited 0; the failing worker's exit code, or 128+signal when it was
    killed by a signal; 124 on timeout; 128+signal when the launcher itself was
    interrupted.  ``failed_worker`` is the index of the worker whose failure
    brought the cluster down (None on success, timeout or interruption).
    ``outputs`` holds each worker's full merged stdout/stderr, unprefixed (a line
    that a progress bar redrew in place keeps only its last state).
    ``message`` is a human-readable summary (the failure report on error).
    ``restarts`` is how many times the cluster was started again after a
    worker failure; ``outputs``, ``addresses`` and ``worker_returncodes``
    describe the last start.  ``spawn_failed`` is True when ``failed_worker``
    could not be started at all (such a failure is never retried).
    """

    returncode: int
    failed_worker: int | None
    outputs: list[str]
    message: str
    addresses: list[str] = dataclasses.field(default_factory=list)
    worker_returncodes: list[int | None] = dataclasses.field(default_factory=list)
    timed_out: bool = False
    interrupted_by: int | None = None  # signal number, if the launcher was signalled
    restarts: int = 0  # how many times the whole cluster was started again
    spawn_failed: bool = False  # failed_worker could not even be started

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def pick_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``n`` distinct ports that are currently free on ``host``.

    All sockets stay bound until every port has been chosen; otherwise the
    kernel could hand the same ephemeral port out twice.  There is an
    unavoidable window between closing them and the workers binding, but the
    kernel cycles through the ephemeral range, so reuse within that window is
    very unlikely.
    """
    if n < 1:
        raise ValueError(f"need at least one port, got {n}")
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                              socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def build_tf_config(addresses: Sequence[str], index: int) -> dict:
    """TF_CONFIG for worker ``index`` of a worker-only cluster."""
    return {
        "cluster": {"worker": list(addresses)},
        "task": {"type": "worker", "index": index},
    }


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_code_for(returncode: int) -> int:
    """Map a Popen returncode to a shell-style exit status (never 0 for failures)."""
    if returncode < 0:
        return 128 + (-returncode)
    if returncode > 255:  # cannot be represented by exit(); still must be non-zero
        return 1
    return returncode if returncode > 0 else 1


class _Worker:
    """One launched process plus the thread that relays its output."""

    def __init__(self, index: int, address: str, proc: subprocess.Popen,
                 output: IO[str], lock: threading.Lock,
                 echo: Callable[[str], bool] | None = None, shown: bool = True):
        self.index = index
        self.address = address
        self.proc = proc
        self.prefix = f"[w{index}] "
        self.lines: list[str] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._output = output
        self._lock = lock
        self._output_broken = False
        self._echo = echo
        self._shown = shown
        self.reader = threading.Thread(
            target=self._relay, name=f"tfgc-launch-w{index}", daemon=True)

    def _relay(self) -> None:
        # Read raw bytes and decode leniently: a worker printing invalid UTF-8
        # must not kill the relay (that would eventually block the worker on
        # a full pipe).
        stream = self.proc.stdout
        assert stream is not None
        for raw in iter(stream.readline, b""):
            line = collapse_progress(raw.decode("utf-8", errors="replace"))
            if not line.endswith("\n"):
                line += "\n"  # last line without newline: still keep lines whole
            self.lines.append(line)
            self.tail.append(line.rstrip("\n"))
            if self._output_broken or not self._shown:
                continue  # keep draining so the worker never blocks on the pipe
            if self._echo is not None and not self._echo(line):
                continue  # kept in lines and tail, not shown
            with self._lock:  # one whole line at a time across workers
                try:
                    self._output.write(self.prefix + line)
                    self._output.flush()
                except (OSError, ValueError):
                    # e.g. `tfgc-launch ... | head`: stop echoing, keep draining.
                    self._output_broken = True
        try:
            stream.close()
        except OSError:
            pass

    def signal_group(self, signum: int) -> None:
        # Each worker is its own session / process-group leader, so killpg also
        # reaches anything it spawned (data loaders, compilers, shells).
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> int | None:
        return self.proc.poll()


class _SignalCatcher:
    """Records SIGINT/SIGTERM delivered to the launcher while workers run.

    Handlers are installed before the workers are spawned (so a Ctrl-C during
    start-up is not lost) and restored afterwards.  Only possible from the main
    thread; :func:`launch` called from another thread simply does not forward.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self.received.append(signum)

    def __enter__(self) -> "_SignalCatcher":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)


def _tail_report(worker: _Worker) -> str:
    lines = list(worker.tail)
    if not lines:
        return "  (no output)"
    return "\n".join(worker.prefix + line for line in lines)


def launch(
    command: Sequence[str],
    num_workers: int,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
    output: IO[str] | None = None,
    *,
    host: str = "127.0.0.1",
    cwd: str | os.PathLike | None = None,
    restarts: int = 0,
    log: IO[str] | None = None,
    echo: Callable[[str], bool] | None = None,
    prebuild_ops: bool = True,
    show_workers: Iterable[int] | None = None,
) -> LaunchResult:
    """Run ``command`` as ``num_workers`` local TF workers and wait for them.

    ``env`` is laid over the launcher's own environment (it does not replace
    it); the per-worker variables ``TF_CONFIG``, ``TFGC_WORKER_INDEX``,
    ``TFGC_NUM_WORKERS``, ``TFGC_RESTART_COUNT`` and ``PYTHONUNBUFFERED``
    always win.  Worker output is echoed line by line, prefixed with
    ``[w{i}] ``, to ``output`` (default: the current ``sys.stdout``).  The
    final result is not printed here (the CLI prints ``result.message`` on
    failure); only restart notices are written, to ``log`` (default: the
    current ``sys.stderr``). ``echo``, if given, decides which lines are
    echoed (it gets each line, newline included); the others are still kept in
    ``outputs`` and in the tail shown when a worker fails. ``show_workers``, if
    given, names the workers whose output is echoed at all (the CLI shows worker
    0 alone unless ``--all-workers``: every worker of a data-parallel script
    prints the same progress); the others' output is kept all the same.

    When called from the main thread, SIGINT/SIGTERM sent to this process are
    forwarded to every worker's process group; workers still alive ``grace``
    seconds later are SIGKILLed.  The same escalation is used when one worker
    fails or ``timeout`` expires.

    ``restarts`` is how many times the whole cluster may be started again
    after a worker failure (see the module docstring).  ``timeout`` covers
    the whole run, restarts included.  ``outputs``, ``addresses`` and
    ``worker_returncodes`` of the result describe the last start only.

    ``prebuild_ops`` (default on): when tfgc was installed without its
    compiled op library (a plain ``pip install``), compile it into the cache
    once before the workers start (see ``_prebuild_custom_ops``).
    """
    command = list(command)
    if not command:
        raise ValueError("no command given to launch")
    if int(num_workers) != num_workers or num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    num_workers = int(num_workers)
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if grace < 0:
        raise ValueError(f"grace must be >= 0, got {grace}")
    # bool is an int subclass, but restarts=True is almost certainly a mistake.
    if (isinstance(restarts, bool) or not isinstance(restarts, numbers.Integral)
            or restarts < 0):
        raise ValueError(f"restarts must be an integer >= 0, got {restarts!r}")
    restarts = int(restarts)
    # Once, before the first start: restarts show the same workers.
    shown = None if show_workers is None else frozenset(int(i) for i in show_workers)
    if output is None:
        # Resolve at call time, not import time, so redirected/captured stdout works.
        output = sys.stdout
    if log is None:
        log = sys.stderr

    base_env = dict(os.environ)
    if env:
        base_env.update({str(k): str(v) for k, v in env.items()})
    if prebuild_ops:
        _prebuild_custom_ops(base_env, cwd, log)

    start = time.monotonic()
    deadline = None if timeout is None else start + timeout

    # One catcher for the whole run, so a Ctrl-C that lands between two starts
    # (while the failed cluster is torn down or the new one spawned) is seen.
    with _SignalCatcher() as catcher:
        attempt = 0
        while True:
            result = _run_cluster(
                command, num_workers, base_env, grace, output, host, cwd,
                catcher, start, timeout, deadline, attempt, echo, shown)
            result.restarts = attempt
            if result.ok or result.failed_worker is None or result.spawn_failed:
                # Success, timeout, interruption, or a command that cannot even
                # be started (starting it again would not help).
                return result
            if attempt == restarts:
                if restarts:
                    result.message += (f"\n{PROG}: no restarts left "
                                       f"({restarts} of {restarts} used)")
                return result
            if catcher.received:
                # Signalled while the failed cluster was being stopped: the
                # user wants out, so report the failure and do not restart.
                return result
            if deadline is not None and time.monotonic() >= deadline:
                result.message += (f"\n{PROG}: not restarting: the --timeout of "
                                   f"{timeout:g} s has run out")
                return result
            attempt += 1
            _notify(output, log,
                    f"{result.message}\n{PROG}: worker {result.failed_worker} "
                    f"{_describe_exit(result.worker_returncodes[result.failed_worker])}; "
                    f"restarting the cluster (restart {attempt} of {restarts})")


def _prebuild_custom_ops(env: Mapping[str, str], cwd, log: IO[str]) -> None:
    """Compile tfgc's op library into the cache before the workers start.

    Only needed after an install that could not compile it (pip's isolated
    build has no TensorFlow). The workers would otherwise build it at their
    first step, one compiling under the cache's file lock and the others
    waiting for about a minute; doing it here keeps that out of the timed
    run and shows its progress once. Runs ``python -m tfgc.ops.build`` in a
    child (this module stays free of TensorFlow); a no-op when the installed
    library exists, the ops are disabled, or another library is named. A
    failed build is reported and the workers still start: each then says once
    that it runs the reference ops.
    """
    # Imports absl but not TensorFlow: starting the launcher stays fast.
    from tfgc.ops import _loader  # pylint: disable=import-outside-toplevel

    if (_loader.custom_ops_disabled(env) or env.get(_loader.LIBRARY_ENV_VAR, "").strip()
            or not _loader.jit_build_enabled(env)
            or os.path.exists(_loader.packaged_library_path())):
        return
    build_env = dict(env)
    build_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        proc = subprocess.run([sys.executable, "-m", "tfgc.ops.build"], env=build_env, cwd=cwd,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=log if _has_fileno(log) else subprocess.PIPE,
                              text=True, check=False)
    except OSError as exc:
        _notify(log, log, f"{PROG}: could not run `{_loader.BUILD_COMMAND}` ({exc}); "
                          "the workers will try to build the custom ops themselves")
        return
    if proc.stderr:
        _notify(log, log, proc.stderr.rstrip("\n"))
    if proc.returncode != 0:
        _notify(log, log, f"{PROG}: building the custom ops failed (exit status "
                          f"{proc.returncode}); the workers will run the reference ops")


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {-returncode} ({_signal_name(-returncode)})"
    return f"exited with code {returncode}"


def _notify(output: IO[str], log: IO[str], text: str) -> None:
    """Write a launcher notice to ``log``, after whatever workers printed."""
    try:
        output.flush()
    except (OSError, ValueError):
        pass
    try:
        log.write(text + "\n")
        log.flush()
    except (OSError, ValueError):
        pass  # a closed or broken stream must not stop the launcher


def _run_cluster(
    command: list[str],
    num_workers: int,
    base_env: Mapping[str, str],
    grace: float,
    output: IO[str],
    host: str,
    cwd: str | os.PathLike | None,
    catcher: _SignalCatcher,
    start: float,
    timeout: float | None,
    deadline: float | None,
    restart_count: int,
    echo: Callable[[str], bool] | None = None,
    shown: frozenset[int] | None = None,
) -> LaunchResult:
    """Start the cluster once (fresh ports), supervise it, and tear it down."""
    ports = pick_free_ports(num_workers, host)
    addresses = [_format_address(host, p) for p in ports]
    lock = threading.Lock()
    workers: list[_Worker] = []

    # --- spawn ---------------------------------------------------------------
    for i in range(num_workers):
        wenv = dict(base_env)
        wenv.update({
            "TF_CONFIG": json.dumps(build_tf_config(addresses, i)),
            "TFGC_WORKER_INDEX": str(i),
            "TFGC_NUM_WORKERS": str(num_workers),
            "TFGC_RESTART_COUNT": str(restart_count),
            "PYTHONUNBUFFERED": "1",
        })
        try:
            proc = subprocess.Popen(
                command,
                env=wenv,
                cwd=cwd,
                stdin=subprocess.DEVNULL,  # workers have no terminal to read
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # merged, so lines keep their order
                start_new_session=True,    # own group: signal it as a unit
            )
        except OSError as exc:
            _stop(workers, signal.SIGKILL, 0.0, catcher)
            _join_readers(workers, 2.0)
            msg = f"{PROG}: cannot start worker {i} ({command[0]!r}): {exc}"
            return LaunchResult(
                returncode=SPAWN_FAILURE_EXIT_CODE, failed_worker=i,
                outputs=[''.join(w.lines) for w in workers] + [""] * (num_workers - len(workers)),
                message=msg, addresses=addresses,
                worker_returncodes=[w.proc.returncode for w in workers]
                + [None] * (num_workers - len(workers)),
                spawn_failed=True)
        worker = _Worker(i, addresses[i], proc, output, lock, echo,
                         shown=shown is None or i in shown)
        workers.append(worker)
        worker.reader.start()

    # --- supervise -----------------------------------------------------------
    failed: _Worker | None = None
    timed_out = False
    interrupted_by: int | None = None
    while True:
        if catcher.received:
            interrupted_by = catcher.received[0]
            # Forward the very signal the user sent (Ctrl-C -> SIGINT) so
            # workers can run their own KeyboardInterrupt clean-up.
            _stop(workers, interrupted_by, grace, catcher)
            break
        codes = [w.poll() for w in workers]
        bad = [w for w, c in zip(workers, codes) if c not in (None, 0)]
        if bad:
            failed = bad[0]
            # Peers are likely blocked in a collective waiting for the dead
            # worker; they will never finish on their own.
            _stop(workers, signal.SIGTERM, grace, catcher)
            break
        if all(c == 0 for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            _stop(workers, signal.SIGTERM, grace, catcher)
            break
        time.sleep(_POLL_S)

    # Collect the remaining output.  Normally the pipes close when the
    # workers exit; a leftover grandchild holding the pipe open is killed
    # with its group rather than waited for.
    _join_readers(workers, 2.0)
    stragglers = [w for w in workers if w.reader.is_alive()]
    for w in stragglers:
        w.signal_group(signal.SIGKILL)
    _join_readers(stragglers, 2.0)

    outputs = ["".join(w.lines) for w in workers]
    worker_codes = [w.proc.returncode for w in workers]
    elapsed = time.monotonic() - start
    after = ""
    if restart_count:
        after = f", after {restart_count} restart{'s' if restart_count > 1 else ''}"

    if failed is not None:
        rc = failed.proc.returncode
        shown = len(failed.tail)
        what = "line" if shown == 1 else "lines"
        message = (
            f"{PROG}: worker {failed.index} {_describe_exit(rc)} ({failed.address}); "
            f"last {shown} {what} of its output:\n{_tail_report(failed)}"
        )
        return LaunchResult(_exit_code_for(rc), failed.index, outputs, message,
                            addresses, worker_codes)
    if interrupted_by is not None:
        message = (f"{PROG}: received {_signal_name(interrupted_by)}; "
                   f"stopped all {num_workers} workers")
        return LaunchResult(128 + interrupted_by, None, outputs, message,
                            addresses, worker_codes, interrupted_by=interrupted_by)
    if timed_out:
        message = (f"{PROG}: timed out after {timeout:g} s "
                   f"(ran {elapsed:.1f} s{after}); killed all {num_workers} workers")
        return LaunchResult(TIMEOUT_EXIT_CODE, None, outputs, message,
                            addresses, worker_codes, timed_out=True)
    message = (f"{PROG}: all {num_workers} workers exited with code 0 "
               f"({elapsed:.1f} s{after})")
    return LaunchResult(0, None, outputs, message, addresses, worker_codes)


def _stop(workers: Iterable[_Worker], first_signal: int, grace: float,
          catcher: _SignalCatcher | None = None) -> None:
    """Signal every worker group, wait up to ``grace`` s, then SIGKILL the rest.

    The group is signalled even if its leader already exited, so orphans left
    behind by a worker are cleaned up too.  A further SIGINT/SIGTERM to the
    launcher during the grace period (impatient second Ctrl-C) skips straight
    to SIGKILL.  Every worker is reaped before returning, so no zombies remain.
    """
    workers = list(workers)
    seen = len(catcher.received) if catcher else 0
    for w in workers:
        w.signal_group(first_signal)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if all(w.poll() is not None for w in workers):
            break
        if catcher is not None and len(catcher.received) > seen:
            break
        time.sleep(_POLL_S)
    for w in workers:
        # Unconditional: also reaches group members outliving their leader.
        w.signal_group(signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass


def _join_readers(workers: Iterable[_Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for w in workers:
        w.reader.join(max(0.0, deadline - time.monotonic()))


def _restart_count(text: str) -> int:
    """argparse type for --restarts: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --workers N [--host HOST] [--grace S] [--timeout S] "
              "[--restarts N] [--all-workers] [--tf-logs] -- COMMAND [ARGS...]",
        description="Run COMMAND as N local TensorFlow multi-worker processes "
                    "(TF_CONFIG set per worker), show worker 0's output prefixed with "
                    "[w0], and stop the whole cluster as soon as one worker fails "
                    "(its last lines are always shown).",
    )
    parser.add_argument("--all-workers", action="store_true",
                        help="show every worker's output, each line prefixed with [w<i>] "
                             "(default: worker 0's only)")
    parser.add_argument("--tf-logs", action="store_true",
                        help="keep TensorFlow's own start-up and INFO lines (default: "
                             "hidden, and TF_CPP_MIN_LOG_LEVEL=2 unless already set)")
    parser.add_argument("--workers", "-n", type=int, required=True,
                        help="number of worker processes")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the workers bind to (default 127.0.0.1)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM/SIGINT and SIGKILL (default 5)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="kill the cluster and fail if it runs longer than this "
                             "(restarts included)")
    parser.add_argument("--restarts", type=_restart_count, default=0, metavar="N",
                        help="after a worker failure, stop the cluster and start all "
                             "workers again, at most N times (default 0)")
    # Split on the first "--" ourselves: argparse's REMAINDER would otherwise
    # swallow or misinterpret options that belong to the worker command.
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    else:
        own, command = argv, []
    args = parser.parse_args(own)
    if not command:
        parser.error("missing command: put it after '--', e.g. "
                     f"{PROG} --workers 2 -- python train.py")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.grace < 0:
        parser.error("--grace must be >= 0")
    if args.timeout is not None and args.timeout <= 0:
        parser.error("--timeout must be > 0")
    return args, command


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (console scripts sys.exit it)."""
    args, command = _parse_args(sys.argv[1:] if argv is None else argv)
    env = {}
    if not args.tf_logs and "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if args.workers > 1 and not args.all_workers:
        _notify(sys.stdout, sys.stderr,
                f"{PROG}: showing worker 0's output; --all-workers shows every worker's "
                "(a failing worker's last lines are always shown)")
    result = launch(command, args.workers, env=env, timeout=args.timeout, grace=args.grace,
                    output=sys.stdout, host=args.host, restarts=args.restarts,
                    log=sys.stderr,
                    echo=None if args.tf_logs else (lambda line: not is_tensorflow_noise(line)),
                    show_workers=None if args.all_workers else (0,))
    if result.returncode != 0:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        print(result.message, file=sys.stderr, flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
