"""tfgc-launch with real worker processes (no mocks).

The worker "programs" are tiny Python scripts written to tmp_path, so these
tests exercise process groups, pipes and signals exactly as a training run
would, in a few seconds and without TensorFlow in the workers.
"""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tfgc.apps import launch as tl

REPO_ROOT = Path(__file__).resolve().parent.parent


def _write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _launcher_env() -> dict:
    env = dict(os.environ)
    # The launcher subprocess must import this checkout's tfgc, whatever the cwd.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # in case the package imports TF
    return env


def _launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tfgc.apps.launch", *args]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists but not ours: certainly not our worker
        return True
    # A zombie still answers kill(0) but is no longer running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_gone(pids, timeout=5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _pid_alive(p)]
        time.sleep(0.05)
    return alive


def _read_pids(tmp_path: Path, n: int, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [tmp_path / f"pid{i}" for i in range(n)]
        if all(f.exists() and f.read_text().strip() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("workers never wrote their pid files")


# Shared worker preamble: records the pid so tests can check it is gone later.
_PREAMBLE = """
    import os, signal, sys, time
    i = int(os.environ["TFGC_WORKER_INDEX"])
    out = sys.argv[1]
    with open(os.path.join(out, f"pid{i}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid{i}.tmp"), os.path.join(out, f"pid{i}"))
"""


def test_two_workers_get_distinct_tf_config(tmp_path):
    script = _write(tmp_path, "show.py", """
        import json, os, sys
        cfg = json.loads(os.environ["TF_CONFIG"])
        print(json.dumps({"index": cfg["task"]["index"], "type": cfg["task"]["type"],
                          "cluster": cfg["cluster"],
                          "env_index": os.environ["TFGC_WORKER_INDEX"],
                          "env_n": os.environ["TFGC_NUM_WORKERS"],
                          "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
                          "extra": os.environ.get("TFGC_TEST_EXTRA")}))
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no trailing newline")
    """)
    buf = io.StringIO()
    result = tl.launch([sys.executable, script], 2, env={"TFGC_TEST_EXTRA": "x"},
                       timeout=60, output=buf)
    assert result.returncode == 0, result.message
    assert result.failed_worker is None
    assert result.worker_returncodes == [0, 0]

    lines = buf.getvalue().splitlines()
    assert lines and all(l.startswith(("[w0] ", "[w1] ")) for l in lines), lines
    for i in range(2):
        mine = [l[5:] for l in lines if l.startswith(f"[w{i}] ")]
        assert "to stderr" in mine  # stderr is merged into the same stream
        assert "no trailing newline" in mine  # a partial last line is not lost
    infos = [json.loads(l[5:]) for l in lines if l[5:].startswith("{")]
    assert len(infos) == 2
    by_prefix = {int(l[2]): json.loads(l[5:]) for l in lines if l[5:].startswith("{")}
    assert set(by_prefix) == {0, 1}
    for i, info in by_prefix.items():
        assert info["index"] == i and info["type"] == "worker"
        assert info["env_index"] == str(i) and info["env_n"] == "2"
        assert info["unbuffered"] == "1" and info["extra"] == "x"
    cluster = by_prefix[0]["cluster"]
    assert cluster == by_prefix[1]["cluster"]
    assert cluster["worker"] == result.addresses
    ports = [int(a.rsplit(":", 1)[1]) for a in cluster["worker"]]
    assert len(set(ports)) == 2 and all(a.startswith("127.0.0.1:") for a in cluster["worker"])
    # Captured per-worker text is unprefixed.
    assert all("to stderr" in o and "[w" not in o for o in result.outputs)


# What a worker of a TensorFlow script prints: the runtime's native start-up lines, the
# script's own line, and Keras 3's progress bar, which redraws with backspaces and
# carriage returns even into a pipe.
_NOISY = """
    import sys
    i = sys.argv[1]
    print("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
          file=sys.stderr)
    print("I0000 00:00:1795606793.283869    2482 port.cc:153] oneDNN custom operations are on.",
          file=sys.stderr)
    print("E0000 00:00:1795606793.2 2482 cuda_executor.cc:1309] failed call to cuInit: ...",
          file=sys.stderr)
    print(f"worker says hello")
    bar = ""
    for step in range(1, 201):
        previous = bar
        bar = f"{step}/200 [" + "=" * (step // 10) + "] - loss: 0.5"
        sys.stdout.write("\\b" * len(previous) + "\\r" + bar)
    sys.stdout.write("\\n")
    print("done")
"""


def test_cli_shows_worker_zero_without_tensorflow_noise(tmp_path):
    script = _write(tmp_path, "noisy.py", _NOISY)
    proc = subprocess.run(_launcher_cmd("--workers", "2", "--", sys.executable, script, "x"),
                          capture_output=True, text=True, timeout=60, env=_launcher_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # Worker 0 alone, TensorFlow's lines hidden, the progress bar at its final state.
    assert lines == ["[w0] worker says hello",
                     "[w0] 200/200 [" + "=" * 20 + "] - loss: 0.5",
                     "[w0] done"], lines
    assert "--all-workers" in proc.stderr

    proc = subprocess.run(_launcher_cmd("--workers", "2", "--all-workers", "--tf-logs", "--",
                                        sys.executable, script, "x"),
                          capture_output=True, text=True, timeout=60, env=_launcher_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for i in range(2):
        mine = [l[5:] for l in proc.stdout.splitlines() if l.startswith(f"[w{i}] ")]
        assert "worker says hello" in mine and "done" in mine
        assert any("oneDNN custom operations" in l for l in mine)
        assert any(l.startswith("E0000") and "cuInit" in l for l in mine)


@pytest.mark.parametrize("raw, shown", [
    ("plain line\n", "plain line\n"),
    ("\r1/3 [=]\b\b\b\b\b\b\b\r2/3 [==]\b\b\b\b\b\b\b\b\r3/3 [===] done\n", "3/3 [===] done\n"),
    ("step 1\rstep 2\r\n", "step 2\n"),         # a trailing carriage return keeps the text
    ("\r\b\b\n", "\n"),                         # nothing but redraws: an empty line
    ("no newline\rlast", "last"),
])
def test_collapse_progress(raw, shown):
    assert tl.collapse_progress(raw) == shown


def test_failing_worker_stops_cluster_cli(tmp_path):
    # Worker 1 fails once worker 0 is up; worker 0 ignores SIGTERM and sleeps,
    # standing in for a peer stuck in a collective: only SIGKILL stops it.
    script = _write(tmp_path, "fail.py", _PREAMBLE + """
    if i == 1:
        deadline = time.time() + 20
        while not os.path.exists(os.path.join(out, "pid0")) and time.time() < deadline:
            time.sleep(0.02)
        for k in range(30):
            print(f"line {k}")
        sys.exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("worker 0 waiting forever")
    time.sleep(600)
    """)
    start = time.monotonic()
    proc = subprocess.run(
        _launcher_cmd("--workers", "2", "--grace", "1", "--all-workers", "--",
                      sys.executable, script, str(tmp_path)),
        capture_output=True, text=True, timeout=60, env=_launcher_env(), cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    assert elapsed < 30
    assert "worker 1 exited with code 3" in proc.stderr
    assert "last 20 lines of its output:" in proc.stderr
    assert "127.0.0.1:" in proc.stderr
    # The tail shows the end of worker 1's output (last 20 of 30 lines).
    assert "line 29" in proc.stderr and "line 10" in proc.stderr
    assert "[w1] line 9\n" not in proc.stderr
    assert "[w0] worker 0 waiting forever" in proc.stdout
    assert "[w1] line 0" in proc.stdout
    pids = _read_pids(tmp_path, 2, timeout=1)
    assert _wait_gone(pids) == []


def test_worker_killed_by_signal_is_reported(tmp_path):
    script = _write(tmp_path, "die.py", _PREAMBLE + """
    if i == 1:
        # Wait until worker 0 has recorded its pid, so the test can check it is reaped.
        deadline = time.time() + 20
        while not os.path.exists(os.path.join(out, "pid0")) and time.time() < deadline:
            time.sleep(0.02)
        print("about to die", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    """)
    start = time.monotonic()
    result = tl.launch([sys.executable, script, str(tmp_path)], 2, grace=1,
                       timeout=60, output=io.StringIO())
    assert time.monotonic() - start < 15
    assert result.failed_worker == 1
    assert result.returncode == 128 + signal.SIGKILL
    assert "worker 1 was killed by signal 9 (SIGKILL)" in result.message
    assert "about to die" in result.message
    assert _wait_gone(_read_pids(tmp_path, 2, timeout=1)) == []


def test_timeout_kills_cluster(tmp_path, capsys):
    script = _write(tmp_path, "slow.py", _PREAMBLE + """
    print("sleeping")
    time.sleep(600)
    """)
    start = time.monotonic()
    # 3 s: long enough for both workers to start and record their pids on a busy machine.
    rc = tl.main(["--workers", "2", "--timeout", "3", "--grace", "1", "--all-workers", "--",
                  sys.executable, script, str(tmp_path)])
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert rc == tl.TIMEOUT_EXIT_CODE != 0
    assert elapsed < 20
    assert "timed out after 3 s" in captured.err
    assert "[w0] sleeping" in captured.out and "[w1] sleeping" in captured.out
    assert _wait_gone(_read_pids(tmp_path, 2, timeout=1)) == []


def _signal_when_ready(tmp_path, launcher_args, script, ready_lines, sig, pids_fn):
    """Starts the launcher, waits for every ``ready_lines`` line, then sends it ``sig``.

    Returns (launcher exit code, its stderr, the worker pids read once ready).
    """
    proc = subprocess.Popen(
        # Every worker's ready line is awaited: show them all.
        _launcher_cmd(*launcher_args, "--all-workers", "--", sys.executable, script,
                      str(tmp_path)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_launcher_env(), cwd=tmp_path)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    try:
        ready, deadline = set(), time.monotonic() + 30
        while ready != set(ready_lines):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"workers never became ready; got {ready}"
            try:
                ready.add(lines.get(timeout=remaining).strip())
            except queue.Empty:
                pass
        pids = pids_fn()
        proc.send_signal(sig)
        rc = proc.wait(timeout=20)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, stderr, pids


def test_sigint_stops_all_workers(tmp_path):
    script = _write(tmp_path, "ready.py", _PREAMBLE + """
    print("ready", flush=True)
    time.sleep(600)
    """)
    rc, stderr, pids = _signal_when_ready(
        tmp_path, ["--workers", "2", "--grace", "2"], script, {"[w0] ready", "[w1] ready"},
        signal.SIGINT, lambda: _read_pids(tmp_path, 2))
    assert rc == 128 + signal.SIGINT, stderr
    assert "SIGINT" in stderr
    assert _wait_gone(pids) == []


def test_cli_requires_command(capsys):
    with pytest.raises(SystemExit) as exc:
        tl.main(["--workers", "2"])
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err


def test_unstartable_command_is_reported():
    result = tl.launch(["/nonexistent/tfgc-no-such-binary"], 2, output=io.StringIO())
    assert result.returncode == tl.SPAWN_FAILURE_EXIT_CODE
    assert result.failed_worker == 0
    assert "cannot start worker 0" in result.message


def test_pick_free_ports_distinct():
    ports = tl.pick_free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


# --- restarts ------------------------------------------------------------------

# Restart-aware preamble: every start appends its TFGC_RESTART_COUNT and its
# TF_CONFIG cluster to starts{i}, one JSON line per start, and records its pid
# in pid{i}_{count}.  _wait_for_peer(k) blocks until worker k has recorded the
# current start, so a failing worker never takes down a peer that has not yet
# written its record.
_RESTART_PREAMBLE = """
    import json, os, signal, sys, time
    i = int(os.environ["TFGC_WORKER_INDEX"])
    count = int(os.environ["TFGC_RESTART_COUNT"])
    out = sys.argv[1]
    cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
    with open(os.path.join(out, f"starts{i}"), "a") as f:
        f.write(json.dumps({"count": count, "cluster": cluster}) + "\\n")
    with open(os.path.join(out, f"pid{i}_{count}"), "w") as f:
        f.write(str(os.getpid()))

    def _wait_for_peer(k):
        deadline = time.time() + 20
        path = os.path.join(out, f"starts{k}")
        while time.time() < deadline:
            if os.path.exists(path):
                with open(path) as f:
                    if any(json.loads(l)["count"] == count for l in f if l.strip()):
                        return
            time.sleep(0.02)
"""


def _starts(tmp_path: Path, i: int) -> list[dict]:
    path = tmp_path / f"starts{i}"
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def _all_pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in tmp_path.glob("pid*_*")]


def test_restart_after_failure_succeeds(tmp_path):
    # First start: worker 1 exits 1 while worker 0 hangs (a peer stuck in a
    # collective).  Second start: everyone exits 0.
    script = _write(tmp_path, "flaky.py", _RESTART_PREAMBLE + """
    if count == 0:
        if i == 1:
            _wait_for_peer(0)
            print("failing on first start", flush=True)
            sys.exit(1)
        time.sleep(600)
    print(f"start {count} ok")
    """)
    buf, log = io.StringIO(), io.StringIO()
    start = time.monotonic()
    result = tl.launch([sys.executable, script, str(tmp_path)], 2, grace=1,
                       timeout=60, output=buf, restarts=1, log=log)
    assert time.monotonic() - start < 30
    assert result.ok, result.message
    assert result.returncode == 0 and result.failed_worker is None
    assert result.restarts == 1
    assert result.worker_returncodes == [0, 0]
    assert "after 1 restart" in result.message
    # Every worker ran twice, with TFGC_RESTART_COUNT 0 and then 1.
    for i in range(2):
        assert [s["count"] for s in _starts(tmp_path, i)] == [0, 1], i
    # The second start is a fresh cluster: new ports, and the result describes it.
    first, second = _starts(tmp_path, 0)
    assert first["cluster"] != second["cluster"]
    assert second["cluster"] == result.addresses == _starts(tmp_path, 1)[1]["cluster"]
    assert all("start 1 ok" in o for o in result.outputs)
    assert "[w0] start 1 ok" in buf.getvalue() and "[w1] start 1 ok" in buf.getvalue()
    # The failure is reported, then one clear restart line.
    notes = log.getvalue()
    assert "worker 1 exited with code 1" in notes
    assert "[w1] failing on first start" in notes
    assert ("tfgc-launch: worker 1 exited with code 1; "
            "restarting the cluster (restart 1 of 1)") in notes.splitlines()
    assert _wait_gone(_all_pids(tmp_path)) == []


def test_restarts_exhausted_fails_naming_worker(tmp_path):
    script = _write(tmp_path, "always_fail.py", _RESTART_PREAMBLE + """
    if i == 1:
        _wait_for_peer(0)
        print(f"giving up on start {count}", flush=True)
        sys.exit(2)
    time.sleep(600)
    """)
    log = io.StringIO()
    result = tl.launch([sys.executable, script, str(tmp_path)], 2, grace=1,
                       timeout=60, output=io.StringIO(), restarts=2, log=log)
    assert not result.ok
    assert result.returncode == 2
    assert result.failed_worker == 1
    assert result.restarts == 2
    assert "worker 1 exited with code 2" in result.message
    assert "[w1] giving up on start 2" in result.message  # the last start's tail
    assert "no restarts left (2 of 2 used)" in result.message
    # Started 3 times in all (first start + 2 restarts), every worker each time.
    for i in range(2):
        assert [s["count"] for s in _starts(tmp_path, i)] == [0, 1, 2], i
    restart_lines = [l for l in log.getvalue().splitlines() if "restarting the cluster" in l]
    assert restart_lines == [
        "tfgc-launch: worker 1 exited with code 2; restarting the cluster (restart 1 of 2)",
        "tfgc-launch: worker 1 exited with code 2; restarting the cluster (restart 2 of 2)",
    ]
    assert _wait_gone(_all_pids(tmp_path)) == []


@pytest.mark.parametrize("restart_args", [[], ["--restarts", "0"]])
def test_no_restarts_by_default_cli(tmp_path, capsys, restart_args):
    # Would succeed on a second start; without restarts it must fail as before.
    script = _write(tmp_path, "once.py", _RESTART_PREAMBLE + """
    if count == 0 and i == 1:
        _wait_for_peer(0)
        sys.exit(5)
    """)
    rc = tl.main(["--workers", "2", "--grace", "1", "--timeout", "60", *restart_args,
                  "--", sys.executable, script, str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 5
    assert "worker 1 exited with code 5" in err
    assert "restart" not in err
    assert [s["count"] for s in _starts(tmp_path, 1)] == [0]
    assert [s["count"] for s in _starts(tmp_path, 0)] == [0]


@pytest.mark.parametrize("kwargs", [{}, {"restarts": 0}])
def test_no_restarts_by_default_api(tmp_path, kwargs):
    script = _write(tmp_path, "once.py", _RESTART_PREAMBLE + """
    if count == 0 and i == 1:
        _wait_for_peer(0)
        sys.exit(5)
    """)
    log = io.StringIO()
    result = tl.launch([sys.executable, script, str(tmp_path)], 2, grace=1, timeout=60,
                       output=io.StringIO(), log=log, **kwargs)
    assert result.returncode == 5 and result.failed_worker == 1
    assert result.restarts == 0
    assert result.message.startswith("tfgc-launch: worker 1 exited with code 5 (127.0.0.1:")
    assert "restart" not in result.message and log.getvalue() == ""
    for i in range(2):
        assert [s["count"] for s in _starts(tmp_path, i)] == [0], i


def test_restarts_cli_succeeds(tmp_path, capsys):
    script = _write(tmp_path, "once.py", _RESTART_PREAMBLE + """
    if count == 0 and i == 1:
        _wait_for_peer(0)
        sys.exit(5)
    print(f"done {count}")
    """)
    rc = tl.main(["--workers", "2", "--grace", "1", "--timeout", "60", "--restarts", "3",
                  "--all-workers", "--", sys.executable, script, str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert ("tfgc-launch: worker 1 exited with code 5; "
            "restarting the cluster (restart 1 of 3)") in captured.err.splitlines()
    assert "[w0] done 1" in captured.out and "[w1] done 1" in captured.out
    assert [s["count"] for s in _starts(tmp_path, 1)] == [0, 1]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_invalid_restarts_rejected(bad):
    with pytest.raises(ValueError, match="restarts"):
        tl.launch([sys.executable, "-c", "pass"], 1, output=io.StringIO(), restarts=bad)


@pytest.mark.parametrize("bad", ["-1", "x", "1.5"])
def test_invalid_restarts_rejected_cli(capsys, bad):
    with pytest.raises(SystemExit) as exc:
        tl.main(["--workers", "2", "--restarts", bad, "--", sys.executable, "-c", "pass"])
    assert exc.value.code == 2
    assert "--restarts" in capsys.readouterr().err


def test_sigkilled_worker_is_restarted(tmp_path):
    script = _write(tmp_path, "kill_once.py", _RESTART_PREAMBLE + """
    if count == 0:
        if i == 1:
            _wait_for_peer(0)
            print("about to die", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    """)
    log = io.StringIO()
    result = tl.launch([sys.executable, script, str(tmp_path)], 2, grace=1,
                       timeout=60, output=io.StringIO(), restarts=2, log=log)
    assert result.ok, result.message
    assert result.restarts == 1
    notes = log.getvalue()
    assert ("tfgc-launch: worker 1 was killed by signal 9 (SIGKILL); "
            "restarting the cluster (restart 1 of 2)") in notes.splitlines()
    assert "about to die" in notes
    for i in range(2):
        assert [s["count"] for s in _starts(tmp_path, i)] == [0, 1], i
    assert _wait_gone(_all_pids(tmp_path)) == []


def test_timeout_covers_restarts(tmp_path):
    # Every start fails after ~0.3 s, so a per-start timeout would never fire
    # and the run would go through all 100 restarts; the timeout must stop it.
    script = _write(tmp_path, "slow_fail.py", _RESTART_PREAMBLE + """
    if i == 1:
        _wait_for_peer(0)
        time.sleep(0.3)
        sys.exit(1)
    time.sleep(600)
    """)
    start = time.monotonic()
    result = tl.launch([sys.executable, script, str(tmp_path)], 2, grace=1,
                       timeout=2, output=io.StringIO(), restarts=100, log=io.StringIO())
    elapsed = time.monotonic() - start
    assert not result.ok
    assert elapsed < 15
    assert 1 <= result.restarts < 100
    # Either the deadline hit while a cluster ran, or right after a failure.
    assert result.timed_out or "--timeout of 2 s has run out" in result.message
    # restarts + 1 clusters were started; on a loaded machine the deadline can kill
    # the last one before its worker 1 has written down that it started.
    assert result.restarts <= len(_starts(tmp_path, 1)) <= result.restarts + 1
    assert _wait_gone(_all_pids(tmp_path)) == []


def test_sigterm_to_launcher_does_not_restart(tmp_path):
    script = _write(tmp_path, "ready.py", _RESTART_PREAMBLE + """
    print(f"ready {count}", flush=True)
    time.sleep(600)
    """)
    rc, stderr, pids = _signal_when_ready(
        tmp_path, ["--workers", "2", "--grace", "2", "--restarts", "3"], script,
        {"[w0] ready 0", "[w1] ready 0"}, signal.SIGTERM, lambda: _all_pids(tmp_path))
    assert rc == 128 + signal.SIGTERM, stderr
    assert "SIGTERM" in stderr and "restarting" not in stderr
    for i in range(2):
        assert [s["count"] for s in _starts(tmp_path, i)] == [0], i
    assert _wait_gone(pids) == []
