"""Shared plumbing for the benchmark drivers (no TensorFlow imported here).

A driver runs on the host, starts local clusters through ``tfgc.apps.launch`` and reads
back the JSON that worker 0 writes. Workers are the same script run again with
``--worker``; they import TensorFlow, the driver never does.
"""

import json
import os
import re
import statistics
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")

# Let `python benchmarks/<script>.py` find the package without installing it.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def worker_env(extra=None):
    """Environment for launched workers: the repo on PYTHONPATH, TF's C++ logging quiet."""
    path = os.environ.get("PYTHONPATH", "")
    env = {
        "PYTHONPATH": REPO_ROOT + (os.pathsep + path if path else ""),
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    }
    env.update(extra or {})
    return env


def run_cluster(command, num_workers, json_path, timeout, log_file):
    """Runs ``command`` on a local cluster and returns the JSON worker 0 wrote.

    Worker output goes to ``log_file`` (an open text file) rather than the
    terminal, so the driver's own table stays readable. On failure the launcher's
    report (which includes the failing worker's last lines) is raised.
    """
    from tfgc.apps.launch import launch

    if os.path.exists(json_path):
        os.remove(json_path)
    result = launch(command, num_workers, env=worker_env(), timeout=timeout, output=log_file)
    log_file.flush()
    if not result.ok:
        raise RuntimeError(f"cluster failed (exit {result.returncode}):\n{result.message}\n"
                           f"full worker output: {log_file.name}")
    with open(json_path) as f:
        return json.load(f)


def scratch_dir(prefix):
    return tempfile.mkdtemp(prefix=prefix)


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv, parse_args, worker_main, drive):
    """A shaped-link benchmark's entry point: ``argv`` (``sys.argv[1:]`` when None)
    parsed; a cluster worker (``--worker``) runs ``worker_main(args)``, anything else
    ``drive(args, argv)``, whose status is returned."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    return drive(args, argv)


def command_line(script, argv):
    """How the report names its command: ``python benchmarks/<script>`` and ``argv``,
    each argument quoted unless it holds only characters a shell takes as they are."""
    return f"python benchmarks/{script}" + "".join(
        " " + (a if re.match(r"^[\w./=:@+,-]+$", a) else json.dumps(a)) for a in argv)


def median(values):
    return float(statistics.median(values)) if values else float("nan")


def run_header(report):
    """The two Markdown lines that open a sweep's report: its command, and when, on how
    many cores, for how long, and whether it was interrupted."""
    return [f"Command: `{report['command']}`  ",
            f"Started {report['started']} on {report['cpu_count']} cores; "
            f"{report.get('wall_s', 0) / 60:.1f} min in all"
            + ("" if report["complete"] else " (**interrupted: incomplete**)") + ".  "]
