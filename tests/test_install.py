"""Installing tfgc the ordinary way must end with the compiled kernels in use.

A plain ``pip install .`` builds in pip's isolated environment, where
TensorFlow is missing, so the op library is compiled at first use into a
per-TensorFlow cache instead (tfgc/ops/build.py). The slow test below does
exactly what a user does: a fresh virtual environment, ``pip install .``
without ``--no-build-isolation``, then tfgc used from another directory. It
needs a C++ compiler and PyPI (for the build environment's setuptools) and
takes about two minutes on 2 cores; TFGC_SKIP_INSTALL_TEST=1 skips it.

The fast tests cover the cache key and the single fallback warning.
"""

import json
import os
import shutil
import site as sitelib
import subprocess
import sys
import time

import pytest

from tfgc.ops import _loader
from tfgc.ops import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _copy_sources(dest):
    """The files a source checkout of tfgc consists of, without build outputs."""
    os.makedirs(dest)
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(os.path.join(ROOT, name), dest)
    ignore = shutil.ignore_patterns("*.so", "*.o", "*.tmp", "__pycache__", "*.pyc", "_csrc")
    shutil.copytree(os.path.join(ROOT, "tfgc"), os.path.join(dest, "tfgc"), ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "custom_ops", "cc"),
                    os.path.join(dest, "custom_ops", "cc"), ignore=ignore)
    return dest


# ---------------------------------------------------------------------------
# Fast tests


@pytest.fixture
def info():
    return {"version": "2.21.0", "cflags": ["-I/tf/include", "-D_GLIBCXX_USE_CXX11_ABI=1"],
            "lflags": ["-L/tf", "-l:libtensorflow_framework.so.2"], "cuda": False,
            "cuda_version": ""}


def test_cache_key_follows_tensorflow_sources_and_flags(tmp_path, monkeypatch, info):
    for name in build._BUILD_ENV_VARS:  # pylint: disable=protected-access
        monkeypatch.delenv(name, raising=False)
    src = _copy_sources(str(tmp_path / "src"))
    key = build.cache_key(info, src)
    assert key.startswith("tf2.21.0-abi1-")
    assert build.cache_key(dict(info), src) == key
    # The checkout and its copy share entries (same sources, same key).
    assert build.cache_key(info, ROOT) == key

    assert build.cache_key(dict(info, version="2.22.0"), src).startswith("tf2.22.0-abi1-")
    other_abi = dict(info, cflags=["-I/tf/include", "-D_GLIBCXX_USE_CXX11_ABI=0"])
    assert build.cache_key(other_abi, src).startswith("tf2.21.0-abi0-")
    assert build.cache_key(dict(info, lflags=["-L/elsewhere"]), src) != key

    header = os.path.join(src, "custom_ops", "cc", "kernels", "sparsify.h")
    with open(header, "a") as f:
        f.write("\n// changed\n")
    changed = build.cache_key(info, src)
    assert changed != key and changed.startswith("tf2.21.0-abi1-")

    monkeypatch.setenv("CXX", "clang++")
    assert build.cache_key(info, src) not in (key, changed)

    monkeypatch.setenv(build.CACHE_ENV_VAR, str(tmp_path / "cache"))
    assert build.cache_entry(info, src) == os.path.join(str(tmp_path / "cache"), "ops",
                                                        build.cache_key(info, src))


@pytest.fixture
def no_installed_library(tmp_path, monkeypatch):
    """The loader as after a plain install: no library next to it, empty cache."""
    monkeypatch.delenv(_loader.LIBRARY_ENV_VAR, raising=False)
    monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "0")
    monkeypatch.setenv(build.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(_loader, "packaged_library_path",
                        lambda: str(tmp_path / "missing" / _loader.LIBRARY_NAME))
    warnings = []
    monkeypatch.setattr(_loader.logging, "warning",
                        lambda msg, *args: warnings.append(msg % args if args else msg))
    _loader._reset_for_tests()  # pylint: disable=protected-access
    yield warnings
    # Later tests load the real library again.
    _loader._reset_for_tests()  # pylint: disable=protected-access


def test_fallback_warns_once_with_the_fix(no_installed_library, monkeypatch):
    warnings = no_installed_library
    monkeypatch.setenv(_loader.JIT_ENV_VAR, "0")
    for _ in range(3):
        assert _loader.load_library() is None
    assert not _loader.custom_ops_available()
    import tfgc.ops as ops  # pylint: disable=import-outside-toplevel

    ops.pack_sign_bits([1.0, -1.0])  # an op falls back without another warning
    assert len(warnings) == 1, warnings
    assert "reference ops" in warnings[0]
    assert "TFGC_JIT_BUILD=0" in warnings[0]
    assert "python -m tfgc.ops.build" in warnings[0]
    assert _loader.loaded_library_path() is None


def test_a_library_that_does_not_load_falls_back_once(no_installed_library, monkeypatch,
                                                      tmp_path):
    # E.g. built during the install for the TensorFlow that was upgraded since.
    broken = tmp_path / "stale" / _loader.LIBRARY_NAME
    broken.parent.mkdir()
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(_loader, "packaged_library_path", lambda: str(broken))
    monkeypatch.setenv(_loader.JIT_ENV_VAR, "0")
    assert _loader.load_library() is None
    assert _loader.load_library() is None
    assert len(no_installed_library) == 1, no_installed_library
    assert "does not load" in no_installed_library[0]
    assert "python -m tfgc.ops.build" in no_installed_library[0]


def test_the_installed_library_is_preferred(tmp_path, monkeypatch):
    if not os.path.exists(_loader.packaged_library_path()):
        pytest.skip("no library built in place")
    monkeypatch.delenv(_loader.LIBRARY_ENV_VAR, raising=False)
    monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "0")
    monkeypatch.setenv(build.CACHE_ENV_VAR, str(tmp_path / "cache"))
    _loader._reset_for_tests()  # pylint: disable=protected-access
    try:
        assert _loader.custom_ops_available()
        assert _loader.loaded_library_path() == _loader.packaged_library_path()
        assert _loader.library_path() == _loader.packaged_library_path()
        assert not (tmp_path / "cache").exists()  # nothing compiled or looked up
    finally:
        _loader._reset_for_tests()  # pylint: disable=protected-access


def test_failed_build_is_reported_once_and_not_retried(no_installed_library, monkeypatch,
                                                       tmp_path):
    warnings = no_installed_library
    # A "compiler" that fails every compile at once.
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv(_loader.JIT_ENV_VAR, "1")
    assert _loader.load_library() is None
    assert _loader.load_library() is None
    failures = [w for w in warnings if "reference ops" in w]
    assert len(failures) == 1, warnings
    assert "failed" in failures[0] and "python -m tfgc.ops.build --force" in failures[0]
    entries = os.listdir(tmp_path / "cache" / "ops")
    entry = next(tmp_path / "cache" / "ops" / e for e in entries if not e.endswith(".lock"))
    assert (entry / build.FAILED_MARKER).exists()
    assert str(entry / build.BUILD_LOG) in failures[0]
    assert not list(entry.glob("obj-*"))  # objects are cleaned up

    # The next process does not spend the build time again: it reports the
    # earlier failure straight away.
    _loader._reset_for_tests()  # pylint: disable=protected-access
    warnings.clear()
    assert _loader.load_library() is None
    assert len(warnings) == 1 and "earlier build" in warnings[0], warnings


# ---------------------------------------------------------------------------
# The real thing: a plain install into a fresh virtual environment

_PROBE = """
import json, os, sys, time
start = time.time()
import numpy as np
import tfgc, tfgc.ops as ops
from tfgc.ops import _loader
available = _loader.custom_ops_available()
x = np.array([1.0, -2.0, 0.0, -0.5] * 20, np.float32)
same = bool(np.array_equal(ops.pack_sign_bits(x).numpy(),
                           ops.pack_sign_bits_reference(x).numpy()))
print(json.dumps({"available": available, "loaded": _loader.loaded_library_path(),
                  "tfgc": tfgc.__file__, "same": same, "seconds": time.time() - start}))
"""


def _probe(python, cwd, env):
    return subprocess.Popen([python, "-c", _PROBE], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc, timeout):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out + err
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.skipif(os.environ.get("TFGC_SKIP_INSTALL_TEST", "").strip() not in ("", "0"),
                    reason="TFGC_SKIP_INSTALL_TEST is set")
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++").split()[0]) is None,
                    reason="no C++ compiler")
def test_plain_pip_install_ends_with_the_kernels_in_use(tmp_path):
    src = _copy_sources(str(tmp_path / "tfgc-src"))
    venv = str(tmp_path / "venv")
    cache = str(tmp_path / "cache")
    work = str(tmp_path / "elsewhere")
    os.makedirs(work)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "TFGC_", "PYTHON")) and k != "VIRTUAL_ENV"}
    env.update(TFGC_CACHE_DIR=cache, TF_CPP_MIN_LOG_LEVEL="2", TFGC_BUILD_JOBS="2")

    # A venv that sees this Python's installed packages (TensorFlow is not
    # downloaded again) through a plain path entry: unlike
    # --system-site-packages, that does not run their .pth files, so a tfgc
    # installed there in develop/editable mode cannot shadow the one under test.
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = os.path.join(venv, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in dict.fromkeys(sitelib.getsitepackages()
                                      + [sitelib.getusersitepackages()]) if os.path.isdir(p)]
    with open(os.path.join(site, "_outer_site.pth"), "w") as f:
        f.write("\n".join(outer) + "\n")
    pip = [python, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]

    # What users type: no --no-build-isolation, so pip's build environment has
    # no TensorFlow and nothing is compiled during the install.
    start = time.time()
    proc = subprocess.run(pip + [src], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    install_seconds = time.time() - start
    installed = os.path.join(site, "tfgc", "ops")
    assert not os.path.exists(os.path.join(installed, _loader.LIBRARY_NAME))
    assert os.path.exists(os.path.join(installed, "_csrc", "custom_ops", "cc", "ops",
                                       "sparsify_ops.cc"))

    # First use: two processes at once, like the workers of a local cluster.
    # One compiles into the cache, the other waits for it; both then run the
    # compiled kernels.
    start = time.time()
    procs = [_probe(python, work, env) for _ in range(2)]
    results = [_result(p, timeout=900) for p in procs]
    build_seconds = time.time() - start
    for result, _ in results:
        assert result["available"] is True
        assert result["same"] is True
        assert result["tfgc"].startswith(site)
        assert result["loaded"].startswith(os.path.join(cache, "ops") + os.sep)
    assert results[0][0]["loaded"] == results[1][0]["loaded"]
    library = results[0][0]["loaded"]
    compiles = [err.count("compiling the custom ops for TensorFlow") for _, err in results]
    assert sorted(compiles) == [0, 1], [err for _, err in results]
    print(*(err for _, err in results), sep="\n")
    assert "reference ops" not in results[0][1] + results[1][1]
    mtime = os.path.getmtime(library)

    # Later processes load the cached library without compiling.
    result, err = _result(_probe(python, work, env), timeout=300)
    assert result["available"] and result["loaded"] == library, err
    assert "compiling" not in err and "waiting" not in err
    assert os.path.getmtime(library) == mtime

    # An editable install of the same sources finds them in the source tree
    # and shares the cache entry. (Not checkable when a regular tfgc install
    # on the outer path comes before the editable finder.)
    if any(os.path.exists(os.path.join(p, "tfgc", "__init__.py")) for p in outer):
        return
    proc = subprocess.run(pip + ["-e", src], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result, err = _result(_probe(python, work, env), timeout=300)
    assert result["tfgc"].startswith(src), result
    assert result["available"] and result["loaded"] == library, err
    assert "compiling" not in err

    print(f"install {install_seconds:.0f} s, first use with build {build_seconds:.0f} s, "
          f"cached load {result['seconds']:.0f} s")


# ---------------------------------------------------------------------------
# tfgc-launch builds the library once, before the workers start


def test_launch_builds_the_ops_before_starting_workers(tmp_path, monkeypatch):
    import io  # pylint: disable=import-outside-toplevel

    from tfgc.apps import launch as launch_mod  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(_loader, "packaged_library_path",
                        lambda: str(tmp_path / "missing" / _loader.LIBRARY_NAME))
    cache = tmp_path / "cache"
    # A compiler that fails at once: the build runs (and fails) in the
    # launcher, before any worker, which then starts anyway.
    env = {build.CACHE_ENV_VAR: str(cache), "CXX": "false", _loader.DISABLE_ENV_VAR: "0",
           _loader.JIT_ENV_VAR: "1", _loader.LIBRARY_ENV_VAR: ""}
    marker = tmp_path / "worker-ran"
    log = io.StringIO()
    result = launch_mod.launch([sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
                               1, env=env, output=io.StringIO(), log=log, timeout=300)
    assert result.ok and marker.exists()
    text = log.getvalue()
    assert "compiling the custom ops for TensorFlow" in text, text
    assert "building the custom ops failed" in text and "reference ops" in text, text
    entries = [e for e in cache.joinpath("ops").iterdir() if not e.name.endswith(".lock")]
    assert len(entries) == 1 and (entries[0] / build.FAILED_MARKER).exists()

    # Nothing is built when the ops are switched off, or with prebuild_ops=False.
    for extra, kwargs in (({_loader.DISABLE_ENV_VAR: "1"}, {}),
                          ({_loader.JIT_ENV_VAR: "0"}, {}),
                          ({}, {"prebuild_ops": False})):
        other = tmp_path / f"cache-{len(extra)}-{len(kwargs)}-{sorted(extra)}"
        log = io.StringIO()
        result = launch_mod.launch([sys.executable, "-c", "pass"], 1,
                                   env=dict(env, **extra, **{build.CACHE_ENV_VAR: str(other)}),
                                   output=io.StringIO(), log=log, timeout=300, **kwargs)
        assert result.ok and not other.exists(), (extra, kwargs, log.getvalue())
        assert "compiling" not in log.getvalue()
