"""Compiles tfgc's TensorFlow op library (``_tfgc_ops.so``).

Two callers share the compile logic in this module:

* ``setup.py`` builds the library into the source tree when TensorFlow is
  importable by the Python running the build (``pip install
  --no-build-isolation``, ``python setup.py build_ext --inplace``);
* the loader (``tfgc.ops._loader``) builds it at first use into a per-user
  cache when no library was installed, which is what happens after a plain
  ``pip install .`` or ``pip install -e .``: pip builds the package in an
  isolated environment without TensorFlow, so nothing could be compiled then.

The cache lives in ``${TFGC_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/tfgc}/ops``,
one directory per combination of TensorFlow version, C++ ABI, compile/link
flags and op sources, so that upgrading TensorFlow or tfgc triggers exactly
one new build and never loads a stale library.

Build (or rebuild) the cached library explicitly, e.g. before starting the
workers of a cluster, with::

    python -m tfgc.ops.build            # no-op when it is already built
    python -m tfgc.ops.build --force    # rebuild, also after a failed build

This module only uses the standard library at import time: ``setup.py``
loads it by path inside pip's build environment, where neither TensorFlow nor
absl are installed.

Environment knobs (shared with setup.py):
    CXX                     compiler to use (default g++)
    TFGC_BUILD_JOBS         parallel compile jobs
    TFGC_BUILD_CUDA=0       CPU-only library even with a CUDA-enabled TensorFlow
    NVCC, CUDA_HOME         CUDA compiler (default: nvcc on PATH, then $CUDA_HOME/bin)
    TFGC_CUDA_ARCH          comma-separated GPU targets, e.g. "sm_80,sm_90"
    TFGC_CUDA_LDFLAGS       link flags for the CUDA runtime
    TFGC_CACHE_DIR          root of the build cache (default ~/.cache/tfgc)
"""

import contextlib
import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

LIBRARY_NAME = "_tfgc_ops.so"
CACHE_ENV_VAR = "TFGC_CACHE_DIR"
# Bumped when the layout of a cache entry changes.
CACHE_FORMAT = 1

# Portable on purpose: no -march, the library has to load on every host that
# can run the TensorFlow wheel. The loops are written to vectorise with the
# baseline ISA.
BASE_CXXFLAGS = [
    "-std=c++17",
    "-fPIC",
    "-O3",
    "-DNDEBUG",
    "-Wno-deprecated-declarations",
]

# Environment variables that change what gets compiled; part of the cache key.
_BUILD_ENV_VARS = ("CXX", "TFGC_BUILD_CUDA", "NVCC", "CUDA_HOME", "CUDA_PATH",
                   "TFGC_CUDA_ARCH", "TFGC_CUDA_LDFLAGS")

_HERE = os.path.dirname(os.path.abspath(__file__))
# Where a wheel carries the sources (setup.py's build_py copies them there).
PACKAGED_SOURCE_ROOT = os.path.join(_HERE, "_csrc")


class BuildError(RuntimeError):
    """The library could not be built; ``log_path`` holds the details if set."""

    def __init__(self, message, log_path=None):
        super().__init__(message)
        self.log_path = log_path


def falsy(value):
    """Whether an environment flag's value turns it off ("0", "false", "no", "off")."""
    return value.strip().lower() in ("0", "false", "no", "off")


def _print_warning(msg):
    bar = "=" * 78
    print(f"\n{bar}\nWARNING (tfgc): {msg}\n{bar}\n", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Sources


def cc_dir(src_root):
    return os.path.join(src_root, "custom_ops", "cc")


def find_source_root():
    """Directory holding ``custom_ops/cc``, or None when the sources are absent.

    A wheel carries them under ``tfgc/ops/_csrc``; an editable install or a
    source checkout has them at the repository root, two levels above the
    package directory.
    """
    candidates = [PACKAGED_SOURCE_ROOT, os.path.dirname(os.path.dirname(_HERE))]
    for root in candidates:
        if glob.glob(os.path.join(cc_dir(root), "**", "*.cc"), recursive=True):
            return root
    return None


def cc_sources(src_root):
    # *.cu.cc files are CUDA translation units, compiled by nvcc (see below).
    found = glob.glob(os.path.join(cc_dir(src_root), "**", "*.cc"), recursive=True)
    return sorted(p for p in found if not p.endswith(".cu.cc"))


def cuda_sources(src_root):
    return sorted(glob.glob(os.path.join(cc_dir(src_root), "**", "*.cu.cc"), recursive=True))


def headers(src_root, cuda=False):
    patterns = ["*.h"] + (["*.cuh"] if cuda else [])
    found = []
    for pattern in patterns:
        found += glob.glob(os.path.join(cc_dir(src_root), "**", pattern), recursive=True)
    return sorted(found)


def all_source_files(src_root):
    """Every file the library is compiled from (C++, CUDA and headers)."""
    return sorted(set(cc_sources(src_root) + cuda_sources(src_root)
                      + headers(src_root, cuda=True)))


def source_digest(src_root):
    """Hash of the op sources and of this build script."""
    digest = hashlib.sha256()
    files = [(os.path.relpath(p, src_root), p) for p in all_source_files(src_root)]
    files.append(("<build.py>", os.path.abspath(__file__)))
    for rel, path in files:
        digest.update(rel.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# TensorFlow and compilers

_INFO_CODE = (
    "import json, tensorflow as tf;"
    "print(json.dumps({'version': tf.__version__,"
    " 'cflags': tf.sysconfig.get_compile_flags(),"
    " 'lflags': tf.sysconfig.get_link_flags(),"
    " 'cuda': bool(tf.test.is_built_with_cuda()),"
    " 'cuda_version': str(getattr(tf.sysconfig, 'get_build_info', dict)()"
    ".get('cuda_version', ''))}))"
)


def tensorflow_build_info(python=None):
    """(flags of the TensorFlow importable by ``python``, None) or (None, error).

    Asked in a child process: importing TensorFlow into the setup process is
    slow, noisy and could abort it outright (e.g. on a broken CUDA install).
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run([python or sys.executable, "-c", _INFO_CODE],
                              capture_output=True, text=True, env=env, check=False)
    except OSError as exc:
        return None, str(exc)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"exit status {proc.returncode}"
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]), None
    except (ValueError, IndexError):
        return None, "could not parse TensorFlow build flags"


def tensorflow_build_info_in_process():
    """The same as ``tensorflow_build_info`` from the TensorFlow already imported."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    try:
        cuda_version = str(tf.sysconfig.get_build_info().get("cuda_version", ""))
    except Exception:  # pylint: disable=broad-except
        cuda_version = ""
    return {
        "version": tf.__version__,
        "cflags": list(tf.sysconfig.get_compile_flags()),
        "lflags": list(tf.sysconfig.get_link_flags()),
        "cuda": bool(tf.test.is_built_with_cuda()),
        "cuda_version": cuda_version,
    }


def compiler():
    return shlex.split(os.environ.get("CXX", "g++"))


def _is_gcc(cxx):
    try:
        out = subprocess.run(cxx + ["--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    return "Free Software Foundation" in out


def _mtime(path):
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def default_jobs():
    value = os.environ.get("TFGC_BUILD_JOBS", "").strip()
    if value:
        return max(1, int(value))
    # Each translation unit pulls in TensorFlow's headers (about 1 GB of
    # compiler memory); a handful in parallel is plenty for 8 files.
    return max(1, min(os.cpu_count() or 1, 8))


# ---------------------------------------------------------------------------
# Optional CUDA kernels. Only used when the TensorFlow is built with CUDA and
# nvcc is found; cuda_config returns None otherwise, and the build is then
# exactly the CPU-only one.


def _find_nvcc():
    explicit = os.environ.get("NVCC")
    if explicit:
        return shutil.which(explicit) or (explicit if os.path.exists(explicit) else None)
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(cuda_home, "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


def _nvcc_version(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        return out.split("release", 1)[1].split(",", 1)[0].strip()
    except (OSError, IndexError):
        return ""


def _same_cuda_major(nvcc_version, tf_version):
    return bool(nvcc_version) and nvcc_version.split(".")[0] == tf_version.split(".")[0]


def cuda_config(info, src_root, log=print, warn=_print_warning):
    """nvcc command prefix and CUDA link flags, or None for a CPU-only build."""
    if falsy(os.environ.get("TFGC_BUILD_CUDA", "1")):
        return None
    if not info.get("cuda") or not cuda_sources(src_root):
        return None
    nvcc = _find_nvcc()
    if nvcc is None:
        warn("TensorFlow is built with CUDA but nvcc was not found (set NVCC or "
             "CUDA_HOME); building the CPU kernels only.")
        return None
    # Kernels built by another CUDA major version than TensorFlow's may need a
    # newer driver than TensorFlow does and fail at launch; stay CPU-only then.
    nvcc_version = _nvcc_version(nvcc)
    tf_version = info.get("cuda_version", "")
    if not _same_cuda_major(nvcc_version, tf_version):
        log(f"tfgc: TensorFlow is built with CUDA {tf_version or '?'} but {nvcc} is CUDA "
            f"{nvcc_version or '?'}; building the CPU kernels only.")
        return None
    arch = []
    for target in filter(None, os.environ.get("TFGC_CUDA_ARCH", "").replace(" ", "").split(",")):
        arch += ["-gencode", f"arch=compute_{target.split('_')[-1]},code={target}"]
    ldflags = os.environ.get("TFGC_CUDA_LDFLAGS")
    if ldflags is None:
        # The CUDA runtime next to nvcc (nvcc may be a wrapper elsewhere).
        homes = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                 os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "",
                 "/usr/local/cuda"]
        dirs = [os.path.join(h, "lib64") for h in homes if h]
        static = [d for d in dirs if os.path.exists(os.path.join(d, "libcudart_static.a"))]
        if static:
            # Listed after TensorFlow's framework library, whose cudart stub
            # exports the runtime API: those symbols bind there, so the
            # kernels share TensorFlow's CUDA runtime. The static runtime only
            # fills in the rest; no libcudart.so is needed on the loader path.
            ldflags = f"-L{static[0]} -lcudart_static -ldl -lrt -lpthread"
        else:
            ldflags = "-lcudart"
    return {
        "nvcc": [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "-DGOOGLE_CUDA=1", "-x", "cu",
                 "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
                 "-Xcompiler", "-Wno-deprecated-declarations",
                 # Front-end warnings raised inside TensorFlow / absl headers.
                 "-diag-suppress=68,69,186,554,611,970,1427,2810"] + arch,
        "lflags": shlex.split(ldflags),
    }


# ---------------------------------------------------------------------------
# The build itself


def build_library(src_root, out_path, obj_root, info, jobs=2, force=False,
                  log=print, warn=_print_warning):
    """Compiles the op library from ``src_root`` against ``info``'s TensorFlow.

    Objects go to a subdirectory of ``obj_root`` named after the compiler,
    flags and TensorFlow version, and are recompiled only when older than
    their source or any header (unless ``force``). The library is written to
    ``out_path`` through a rename, so a process that has the old one mapped
    keeps working. Returns ``out_path``, or None when no C++ compiler exists.
    Raises ``BuildError`` when compiling or linking fails.
    """
    sources = cc_sources(src_root)
    if not sources:
        raise BuildError(f"no C++ sources under {cc_dir(src_root)}")
    cxx = compiler()
    is_gcc = _is_gcc(cxx)
    if is_gcc is None:
        warn(f"C++ compiler {cxx[0]!r} not found; skipping the custom-op "
             "library (set CXX to choose another compiler).")
        return None

    cflags = BASE_CXXFLAGS + list(info["cflags"]) + ["-I" + src_root]
    if is_gcc:
        # Eigen's thread pool header trips this GCC 12 ABI note in every TU;
        # we do not export those types, so it is noise.
        cflags.append("-Wno-interference-size")
    lflags = list(info["lflags"])

    cuda = cuda_config(info, src_root, log=log, warn=warn)
    if cuda is not None:
        # The .cc files register their GPU kernels under GOOGLE_CUDA; the
        # .cu.cc files hold the device code. TensorFlow's include flags go to
        # nvcc too (only the GOOGLE_CUDA part of a .cu.cc uses them).
        log("tfgc: TensorFlow is built with CUDA; compiling the GPU kernels")
        cflags.append("-DGOOGLE_CUDA=1")
        lflags += cuda["lflags"]
        sources = sources + cuda_sources(src_root)

    # One object directory per (compiler, flags, TensorFlow) combination, so a
    # TensorFlow upgrade or a flag change never links stale objects.
    tag_key = [cxx, cflags, lflags, info["version"]] + ([cuda["nvcc"]] if cuda else [])
    tag = hashlib.sha1(json.dumps(tag_key).encode()).hexdigest()[:12]
    obj_dir = os.path.join(obj_root, tag)
    os.makedirs(obj_dir, exist_ok=True)

    newest_header = max((_mtime(h) or 0.0 for h in headers(src_root, cuda=cuda is not None)),
                        default=0.0)
    plan = []
    for src in sources:
        rel = os.path.relpath(src, cc_dir(src_root))
        obj = os.path.join(obj_dir, rel.replace(os.sep, "__")[: -len(".cc")] + ".o")
        obj_time = _mtime(obj)
        stale = force or obj_time is None or obj_time < max(_mtime(src), newest_header)
        plan.append((src, obj, stale))

    def compile_one(item):
        src, obj, _ = item
        if src.endswith(".cu.cc"):  # only listed when cuda is not None
            cmd = cuda["nvcc"] + list(info["cflags"]) + ["-I" + src_root, "-c", src,
                                                         "-o", obj + ".tmp"]
        else:
            cmd = cxx + cflags + ["-c", src, "-o", obj + ".tmp"]
        log("tfgc: compiling " + os.path.relpath(src, src_root))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return src, cmd, proc.stdout + proc.stderr
        if proc.stderr.strip():  # keep compiler warnings visible
            log(proc.stderr)
        os.replace(obj + ".tmp", obj)
        return None

    todo = [p for p in plan if p[2]]
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            failures = [r for r in pool.map(compile_one, todo) if r]
        if failures:
            for src, cmd, output in failures:
                log(f"tfgc: FAILED {src}\n  {shlex.join(cmd)}\n{output}")
            names = ", ".join(os.path.relpath(f[0], src_root) for f in failures)
            raise BuildError(f"compiling the custom ops failed ({names})")
    else:
        log("tfgc: custom-op objects are up to date")

    # Relink when an object changed, or when the library on disk is not the one
    # last linked from this object directory (e.g. after switching TF versions).
    objects = [p[1] for p in plan]
    stamp = os.path.join(obj_dir, "linked.json")
    lib_time = _mtime(out_path)
    try:
        with open(stamp) as f:
            last = json.load(f)
    except (OSError, ValueError):
        last = None
    current = {"objects": objects, "lib_mtime": lib_time}
    if (force or todo or lib_time is None or last != current
            or lib_time < max(_mtime(o) for o in objects)):
        tmp = f"{out_path}.{os.getpid()}.tmp"
        cmd = cxx + ["-shared"] + objects + ["-o", tmp] + lflags
        log("tfgc: linking " + out_path)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            log(f"tfgc: FAILED link\n  {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise BuildError("linking the custom ops failed")
        # Rename rather than overwrite: a running process may have the old
        # library mapped, and truncating a mapped .so crashes it.
        os.replace(tmp, out_path)
        with open(stamp, "w") as f:
            json.dump({"objects": objects, "lib_mtime": _mtime(out_path)}, f)
    else:
        log("tfgc: custom-op library is up to date")
    return out_path


# ---------------------------------------------------------------------------
# Per-user cache


def cpu_model():
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else what ``platform`` knows,
    else "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform  # pylint: disable=import-outside-toplevel
    return platform.processor() or "unknown"


def cache_root():
    """``$TFGC_CACHE_DIR``, else ``$XDG_CACHE_HOME/tfgc``, else ``~/.cache/tfgc``."""
    explicit = os.environ.get(CACHE_ENV_VAR, "").strip()
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tfgc")


def cxx11_abi(info):
    for flag in info.get("cflags", ()):
        if flag.startswith("-D_GLIBCXX_USE_CXX11_ABI="):
            return flag.rpartition("=")[2]
    return "x"


def cache_key(info, src_root):
    """Directory name of the cache entry for this TensorFlow and these sources.

    Readable prefix (TensorFlow version and C++ ABI) plus a hash over
    everything else the library depends on: TensorFlow's flags, the build
    environment variables, the sources and this script.
    """
    material = {
        "format": CACHE_FORMAT,
        "tf": info["version"],
        "cflags": list(info["cflags"]),
        "lflags": list(info["lflags"]),
        "cuda": bool(info.get("cuda")),
        "cuda_version": info.get("cuda_version", ""),
        "base": BASE_CXXFLAGS,
        "env": {k: os.environ.get(k, "") for k in _BUILD_ENV_VARS},
        "sources": source_digest(src_root),
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    version = "".join(c if c.isalnum() or c in ".+_" else "_" for c in info["version"])
    return f"tf{version}-abi{cxx11_abi(info)}-{digest}"


def cache_entry(info, src_root):
    """Directory of this build's cache entry (may not exist yet)."""
    return os.path.join(cache_root(), "ops", cache_key(info, src_root))


def cached_library_path(info, src_root):
    return os.path.join(cache_entry(info, src_root), LIBRARY_NAME)


def estimated_seconds(src_root, info, jobs):
    """Rough wall time of a full build, for the message shown before it."""
    # Measured on a 2-core x86 VM: about 15 s of compiler time per C++ file,
    # nvcc about four times that per CUDA file.
    cpu_seconds = 15 * len(cc_sources(src_root))
    nvcc = _find_nvcc() if info.get("cuda") else None
    if (nvcc is not None and not falsy(os.environ.get("TFGC_BUILD_CUDA", "1"))
            and _same_cuda_major(_nvcc_version(nvcc), info.get("cuda_version", ""))):
        cpu_seconds += 60 * len(cuda_sources(src_root))
    return int(round(cpu_seconds / max(1, min(jobs, len(cc_sources(src_root)) or 1)) + 5, -1))


@contextlib.contextmanager
def _file_lock(path, on_wait=None):
    """Exclusive advisory lock on ``path``; released when the process dies."""
    try:
        import fcntl  # pylint: disable=import-outside-toplevel
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    with open(path, "a") as handle:
        locked = True
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            # No locking on this file system (some network mounts): build
            # without it; the atomic rename still keeps the result intact.
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


FAILED_MARKER = "FAILED"
BUILD_LOG = "build.log"


def build_cached(info, src_root, jobs=None, force=False, notify=None, done=None):
    """Builds the library into its cache entry once; returns its path.

    Concurrent callers (the workers of a local cluster) serialise on a file
    lock: one compiles, the others wait and then load its result. A failed
    build leaves a marker so that later processes do not each spend minutes
    on the same failure; ``force`` retries it. ``notify(message)`` receives
    the one-line messages before a build and before waiting for another
    process's build; ``done(message)`` the one after a build (default: notify).
    """
    notify = notify or (lambda msg: print(msg, file=sys.stderr, flush=True))
    done = done or notify
    jobs = jobs or default_jobs()
    entry = cache_entry(info, src_root)
    lib = os.path.join(entry, LIBRARY_NAME)
    marker = os.path.join(entry, FAILED_MARKER)
    log_path = os.path.join(entry, BUILD_LOG)
    try:
        os.makedirs(entry, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create the build cache {entry} ({exc}); set "
                         f"{CACHE_ENV_VAR} to a writable directory") from exc

    def waiting():
        notify(f"tfgc: waiting for another process to finish building the custom ops "
               f"in {entry}")

    with _file_lock(entry + ".lock", on_wait=waiting):
        if os.path.exists(lib) and not force:
            return lib
        if os.path.exists(marker) and not force:
            with open(marker) as f:
                reason = f.read().strip() or "unknown error"
            raise BuildError(f"an earlier build for this TensorFlow failed: {reason}",
                             log_path=log_path)
        with contextlib.suppress(OSError):
            os.remove(marker)
        notify(f"tfgc: compiling the custom ops for TensorFlow {info['version']} into "
               f"{entry} (once per TensorFlow version, about "
               f"{estimated_seconds(src_root, info, jobs)} s with {jobs} jobs)")
        start = time.time()
        obj_root = tempfile.mkdtemp(prefix="obj-", dir=entry)
        try:
            with open(log_path, "w") as log_file:
                def log(msg):
                    log_file.write(msg.rstrip("\n") + "\n")
                    log_file.flush()

                log(f"tfgc build of {src_root} with {sys.executable}; TensorFlow {info}")
                try:
                    built = build_library(src_root, lib, obj_root, info, jobs=jobs,
                                          force=True, log=log, warn=log)
                except BuildError as exc:
                    exc.log_path = log_path
                    with open(marker, "w") as f:
                        f.write(str(exc) + "\n")
                    raise
                if built is None:
                    raise BuildError(f"C++ compiler {compiler()[0]!r} not found (install "
                                     "g++ or set CXX)", log_path=log_path)
        finally:
            shutil.rmtree(obj_root, ignore_errors=True)
        done(f"tfgc: custom ops built in {time.time() - start:.0f} s: {lib}")
        return lib


def _build_inplace(jobs, force):
    """``--inplace``: scripts/setup.sh's build of an editable checkout.

    Says once what it is compiling and how long that takes, then a line per
    file; prints nothing when every object and the library are current.
    """
    src_root = os.path.dirname(os.path.dirname(_HERE))
    if not cc_sources(src_root):
        print(f"tfgc: no C++ sources under {cc_dir(src_root)}: --inplace needs a source "
              "checkout", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    info = tensorflow_build_info_in_process()
    announced = []
    lock = threading.Lock()  # compile jobs log from a thread pool

    def log(msg):
        with lock:
            if msg.startswith("tfgc: compiling") and not announced:
                announced.append(True)
                print(f"tfgc: compiling the custom ops for TensorFlow {info['version']} (about "
                      f"{estimated_seconds(src_root, info, jobs)} s for a full build with "
                      f"{jobs} jobs; later runs recompile only what changed)", flush=True)
            if msg.startswith(("tfgc: compiling", "tfgc: FAILED")) or not msg.startswith("tfgc:"):
                print(msg.rstrip("\n"), flush=True)

    start = time.time()
    try:
        build_library(src_root, os.path.join(_HERE, LIBRARY_NAME),
                      os.path.join(src_root, "build", "tfgc_ops"), info, jobs=jobs,
                      force=force, log=log)
    except BuildError as exc:
        print(f"tfgc: {exc}", file=sys.stderr)
        return 1
    if announced:
        print(f"tfgc: custom ops built in {time.time() - start:.0f} s", flush=True)
    return 0


def main(argv=None):
    import argparse  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(
        prog="python -m tfgc.ops.build",
        description="Compile tfgc's custom TensorFlow ops for the installed TensorFlow "
                    f"into the cache ({cache_root()}/ops).")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if built, and retry after a failed build")
    parser.add_argument("--jobs", type=int, default=None,
                        help="parallel compile jobs (default $TFGC_BUILD_JOBS or the CPU count)")
    parser.add_argument("--inplace", action="store_true",
                        help="build next to the loader (tfgc/ops/%s, objects under build/), as "
                             "setup.py does, recompiling only what changed; silent when the "
                             "library is up to date" % LIBRARY_NAME)
    args = parser.parse_args(argv)
    if args.inplace:
        return _build_inplace(args.jobs or default_jobs(), args.force)

    src_root = find_source_root()
    if src_root is None:
        print("tfgc: the C++ sources of the ops are not part of this installation "
              f"({os.path.dirname(_HERE)}); reinstall tfgc from its source tree.",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    info = tensorflow_build_info_in_process()
    try:
        path = build_cached(info, src_root, jobs=args.jobs, force=args.force)
    except BuildError as exc:
        print(f"tfgc: {exc}" + (f"\n  log: {exc.log_path}" if exc.log_path else ""),
              file=sys.stderr)
        return 1
    # Load it here as a check: a library that builds but does not load (an
    # ABI mismatch) is as useless as none.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    try:
        tf.load_op_library(path)
    except Exception as exc:  # pylint: disable=broad-except
        print(f"tfgc: built {path} but it does not load ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 1
    installed = os.path.join(_HERE, LIBRARY_NAME)
    if os.path.exists(installed):
        print(f"tfgc: note: {installed} (built during the install) is loaded first while "
              "it loads; the cached build is used when it does not.", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
