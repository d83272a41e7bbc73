"""scripts/setup.sh on the interpreters a fresh machine has.

Debian 12's /usr/bin/python3 is externally managed (PEP 668): pip refuses to install into
it, so setup installs into the project's virtual environment (.venv) by default and
refuses TFGC_VENV=0 with such an interpreter, before it installs anything.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DETECT = os.path.join(ROOT, "scripts", "externally_managed.py")
SETUP = os.path.join(ROOT, "scripts", "setup.sh")


def _marked(python):
    """Whether ``python``'s standard library carries PEP 668's marker (read directly)."""
    stdlib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    return os.path.isfile(os.path.join(stdlib, "EXTERNALLY-MANAGED"))


def _system_pythons():
    found = []
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(path) and os.path.realpath(path) not in [os.path.realpath(p) for p in found]:
            found.append(path)
    return found


IN_VENV = sys.prefix != sys.base_prefix


@pytest.mark.skipif(not IN_VENV, reason="the suite runs outside a venv (TFGC_VENV=0)")
def test_a_virtual_environment_is_never_externally_managed():
    out = subprocess.run([sys.executable, DETECT], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "no"
    # Its base interpreter may well be (Debian's python3): the marker is read, not skipped.
    base = os.path.join(sys.base_prefix, "bin", os.path.basename(sys.executable))
    if os.path.exists(base):
        out = subprocess.run([base, DETECT], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == ("yes" if _marked(base) else "no")


@pytest.mark.parametrize("python", _system_pythons() or ["(none)"])
def test_detection_follows_the_marker(python):
    if python == "(none)":
        pytest.skip("no system interpreter on this machine")
    out = subprocess.run([python, DETECT], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("yes" if _marked(python) else "no")


def test_setup_refuses_an_externally_managed_interpreter_without_a_venv():
    managed = [p for p in _system_pythons() if _marked(p)]
    if not managed:
        pytest.skip("no externally managed interpreter on this machine")
    env = {**os.environ, "TFGC_VENV": "0", "PYTHON": managed[0]}
    proc = subprocess.run(["bash", SETUP], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "externally managed (PEP 668)" in proc.stdout
    assert "TFGC_VENV" in proc.stdout  # says how to go on
    assert "pip" not in proc.stderr  # stopped before installing anything


@pytest.mark.skipif(not IN_VENV or shutil.which("dpkg") is None,
                    reason="setup's own venv on Debian (dpkg) is what this reruns")
def test_setup_is_silent_when_nothing_is_missing():
    # The suite's own venv has everything: a second setup prints nothing and installs
    # nothing (it used to reinstall the package on every call).
    env = {**os.environ, "TFGC_VENV": sys.prefix}
    env.pop("PYTHON", None)
    proc = subprocess.run(["bash", SETUP], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr
