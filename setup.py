"""Packaging for tfgc, including the optional TensorFlow custom-op library.

The C++ ops under custom_ops/cc are compiled against the TensorFlow that is
importable by the Python running this script, into tfgc/ops/_tfgc_ops.so
(next to its loader, so editable installs and in-place builds find it). Any of
these produces it:

    python setup.py build_ext --inplace
    pip install --no-build-isolation -e .
    pip install --no-build-isolation .

--no-build-isolation matters: in an isolated build environment TensorFlow is
not installed, so the library cannot be built; setup then warns and carries on,
and tfgc falls back to its pure-TensorFlow reference implementations.

Environment knobs:
    CXX                     compiler to use (default g++)
    TFGC_BUILD_JOBS         parallel compile jobs (default 2)
    TFGC_BUILD_CUSTOM_OPS=0 skip the custom-op library entirely
    TFGC_BUILD_CUDA=0       CPU-only library even with a CUDA-enabled TensorFlow
    NVCC                    CUDA compiler (default: nvcc on PATH, then $CUDA_HOME/bin)
    TFGC_CUDA_ARCH          comma-separated GPU targets, e.g. "sm_80,sm_90"
                            (default: nvcc's own default)
    TFGC_CUDA_LDFLAGS       link flags for the CUDA runtime
                            (default: nvcc's static libcudart_static.a)

With a CUDA-enabled TensorFlow (tf.test.is_built_with_cuda()) and an nvcc of
the same CUDA major version as TensorFlow's build, the *.cu.cc kernels are
compiled with nvcc and linked in, and every .cc file is compiled with
-DGOOGLE_CUDA=1 so that it registers its GPU kernels. Otherwise the library is
CPU-only, exactly as without CUDA support.
"""

import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CC_DIR = os.path.join(ROOT, "custom_ops", "cc")
EXT_NAME = "tfgc.ops._tfgc_ops"
LIB_PATH = os.path.join(ROOT, "tfgc", "ops", "_tfgc_ops.so")
OBJ_ROOT = os.path.join(ROOT, "build", "tfgc_ops")

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


def _warn(msg):
    bar = "=" * 78
    print(f"\n{bar}\nWARNING (tfgc): {msg}\n{bar}\n", file=sys.stderr, flush=True)


def _cc_sources():
    # *.cu.cc files are CUDA translation units for a future nvcc step.
    found = glob.glob(os.path.join(CC_DIR, "**", "*.cc"), recursive=True)
    return sorted(p for p in found if not p.endswith(".cu.cc"))


def _cc_headers():
    return sorted(glob.glob(os.path.join(CC_DIR, "**", "*.h"), recursive=True))


def _tensorflow_build_info():
    """Compile/link flags of the importable TensorFlow, or None.

    Asked in a child process: importing TensorFlow into the setup process is
    slow, noisy and could abort it outright (e.g. on a broken CUDA install).
    """
    code = (
        "import json, tensorflow as tf;"
        "print(json.dumps({'version': tf.__version__,"
        " 'cflags': tf.sysconfig.get_compile_flags(),"
        " 'lflags': tf.sysconfig.get_link_flags(),"
        " 'cuda': bool(tf.test.is_built_with_cuda()),"
        " 'cuda_version': str(getattr(tf.sysconfig, 'get_build_info', dict)()"
        ".get('cuda_version', ''))}))"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    except OSError as exc:
        return None, str(exc)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"exit status {proc.returncode}"
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]), None
    except (ValueError, IndexError):
        return None, "could not parse TensorFlow build flags"


def _compiler():
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


# ---------------------------------------------------------------------------
# Optional CUDA kernels. Only used when the importable TensorFlow is built with
# CUDA and nvcc is found; _cuda_config returns None otherwise, and the build
# below is then exactly the CPU-only one.

def _cuda_sources():
    return sorted(glob.glob(os.path.join(CC_DIR, "**", "*.cu.cc"), recursive=True))


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


def _cuda_config(info):
    """nvcc command prefix and CUDA link flags, or None for a CPU-only build."""
    if os.environ.get("TFGC_BUILD_CUDA", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not info.get("cuda") or not _cuda_sources():
        return None
    nvcc = _find_nvcc()
    if nvcc is None:
        _warn("TensorFlow is built with CUDA but nvcc was not found (set NVCC or "
              "CUDA_HOME); building the CPU kernels only.")
        return None
    # Kernels built by another CUDA major version than TensorFlow's may need a
    # newer driver than TensorFlow does and fail at launch; stay CPU-only then.
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        nvcc_version = out.split("release", 1)[1].split(",", 1)[0].strip()
    except (OSError, IndexError):
        nvcc_version = ""
    tf_version = info.get("cuda_version", "")
    if not nvcc_version or nvcc_version.split(".")[0] != tf_version.split(".")[0]:
        print(f"tfgc: TensorFlow is built with CUDA {tf_version or '?'} but {nvcc} is CUDA "
              f"{nvcc_version or '?'}; building the CPU kernels only.", flush=True)
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


def build_custom_ops(jobs=2, force=False):
    """Builds tfgc/ops/_tfgc_ops.so; returns its path, or None if skipped."""
    if os.environ.get("TFGC_BUILD_CUSTOM_OPS", "1").strip().lower() in ("0", "false", "no", "off"):
        _warn("TFGC_BUILD_CUSTOM_OPS=0: not building the custom-op library; "
              "tfgc will use its pure-TensorFlow reference ops.")
        return None
    sources = _cc_sources()
    if not sources:
        return None

    info, err = _tensorflow_build_info()
    if info is None:
        _warn(
            "TensorFlow cannot be imported by this Python "
            f"({sys.executable}): {err}\n"
            "Skipping the custom-op library; tfgc will use its pure-TensorFlow "
            "reference ops (slower).\nInstall TensorFlow first and rebuild with\n"
            "  python setup.py build_ext --inplace\n"
            "or  pip install --no-build-isolation -e ."
        )
        return None

    cxx = _compiler()
    is_gcc = _is_gcc(cxx)
    if is_gcc is None:
        _warn(f"C++ compiler {cxx[0]!r} not found; skipping the custom-op "
              "library (set CXX to choose another compiler).")
        return None

    cflags = BASE_CXXFLAGS + list(info["cflags"]) + ["-I" + ROOT]
    if is_gcc:
        # Eigen's thread pool header trips this GCC 12 ABI note in every TU;
        # we do not export those types, so it is noise.
        cflags.append("-Wno-interference-size")
    lflags = list(info["lflags"])

    cuda = _cuda_config(info)
    if cuda is not None:
        # The .cc files register their GPU kernels under GOOGLE_CUDA; the
        # .cu.cc files hold the device code. TensorFlow's include flags go to
        # nvcc too (only the GOOGLE_CUDA part of a .cu.cc uses them).
        print("tfgc: TensorFlow is built with CUDA; compiling the GPU kernels", flush=True)
        cflags.append("-DGOOGLE_CUDA=1")
        lflags += cuda["lflags"]
        sources = sources + _cuda_sources()

    # One object directory per (compiler, flags, TensorFlow) combination, so a
    # TensorFlow upgrade or a flag change never links stale objects.
    tag_key = [cxx, cflags, lflags, info["version"]] + ([cuda["nvcc"]] if cuda else [])
    tag = hashlib.sha1(json.dumps(tag_key).encode()).hexdigest()[:12]
    obj_dir = os.path.join(OBJ_ROOT, tag)
    os.makedirs(obj_dir, exist_ok=True)

    newest_header = max((_mtime(h) or 0.0 for h in _cc_headers()), default=0.0)
    if cuda is not None:
        # .cu.cc files also include the shared *.cuh device headers.
        cuh = glob.glob(os.path.join(CC_DIR, "**", "*.cuh"), recursive=True)
        newest_header = max([newest_header] + [_mtime(h) or 0.0 for h in cuh])
    plan = []
    for src in sources:
        rel = os.path.relpath(src, CC_DIR)
        obj = os.path.join(obj_dir, rel.replace(os.sep, "__")[: -len(".cc")] + ".o")
        obj_time = _mtime(obj)
        stale = force or obj_time is None or obj_time < max(_mtime(src), newest_header)
        plan.append((src, obj, stale))

    def compile_one(item):
        src, obj, _ = item
        if src.endswith(".cu.cc"):  # only listed when cuda is not None
            cmd = cuda["nvcc"] + list(info["cflags"]) + ["-I" + ROOT, "-c", src, "-o", obj + ".tmp"]
        else:
            cmd = cxx + cflags + ["-c", src, "-o", obj + ".tmp"]
        print("tfgc: compiling", os.path.relpath(src, ROOT), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return src, cmd, proc.stdout + proc.stderr
        if proc.stderr.strip():  # keep compiler warnings visible
            print(proc.stderr, file=sys.stderr, flush=True)
        os.replace(obj + ".tmp", obj)
        return None

    todo = [p for p in plan if p[2]]
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            failures = [r for r in pool.map(compile_one, todo) if r]
        if failures:
            for src, cmd, log in failures:
                print(f"tfgc: FAILED {src}\n  {shlex.join(cmd)}\n{log}", file=sys.stderr)
            raise RuntimeError("tfgc: compiling the custom ops failed (see above)")
    else:
        print("tfgc: custom-op objects are up to date", flush=True)

    # Relink when an object changed, or when the library on disk is not the one
    # last linked from this object directory (e.g. after switching TF versions).
    objects = [p[1] for p in plan]
    stamp = os.path.join(obj_dir, "linked.json")
    lib_time = _mtime(LIB_PATH)
    try:
        with open(stamp) as f:
            last = json.load(f)
    except (OSError, ValueError):
        last = None
    current = {"objects": objects, "lib_mtime": lib_time}
    if force or todo or lib_time is None or last != current or lib_time < max(_mtime(o) for o in objects):
        tmp = LIB_PATH + ".tmp"
        cmd = cxx + ["-shared"] + objects + ["-o", tmp] + lflags
        print("tfgc: linking", os.path.relpath(LIB_PATH, ROOT), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"tfgc: FAILED link\n  {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}", file=sys.stderr)
            raise RuntimeError("tfgc: linking the custom ops failed (see above)")
        # Rename rather than overwrite: a running process may have the old
        # library mapped, and truncating a mapped .so crashes it.
        os.replace(tmp, LIB_PATH)
        with open(stamp, "w") as f:
            json.dump({"objects": objects, "lib_mtime": _mtime(LIB_PATH)}, f)
    else:
        print("tfgc: custom-op library is up to date", flush=True)
    return LIB_PATH


class TfgcBuildExt(build_ext):
    """build_ext that builds the TF op library with the compiler directly.

    distutils' compiler abstraction is bypassed because the flags have to come
    from tf.sysconfig and the output name must be exactly _tfgc_ops.so (no
    Python ABI suffix: it is loaded by tf.load_op_library, not imported).
    The library is always written into the source tree; for non-inplace builds
    (wheels) it is also copied into build_lib.
    """

    def get_ext_filename(self, fullname):
        # Called both with the dotted name and with its last component alone
        # (distutils' get_ext_fullpath); keep the plain ".so" suffix for both.
        if fullname in (EXT_NAME, EXT_NAME.rpartition(".")[2]):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if ext.name != EXT_NAME:
            return super().build_extension(ext)
        jobs = int(os.environ.get("TFGC_BUILD_JOBS", "2"))
        built = build_custom_ops(jobs=jobs, force=self.force)
        if built is None:
            return
        dest = os.path.abspath(self.get_ext_fullpath(ext.name))
        if dest != os.path.abspath(built):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(built, dest)

    def copy_extensions_to_source(self):
        # Our library is already in the source tree; copying it over itself
        # would only truncate a file other processes may have mapped.
        others = [e for e in self.extensions if e.name != EXT_NAME]
        if others:
            saved, self.extensions = self.extensions, others
            try:
                super().copy_extensions_to_source()
            finally:
                self.extensions = saved


setup(
    name="tfgc",
    version="0.1.0",
    description="Gradient compression for TensorFlow multi-worker training",
    packages=find_packages(include=["tfgc", "tfgc.*"]),
    python_requires=">=3.9",
    # TensorFlow itself is intentionally not listed: CPU hosts install
    # tensorflow-cpu==2.21.*, GPU hosts tensorflow[and-cuda]==2.21.*, and pip
    # would otherwise pull in (or fight over) one of the two. Install the one
    # that fits the host before installing tfgc.
    install_requires=[
        "tf-keras==2.21.*",
        "numpy",
        "absl-py",
    ],
    extras_require={
        "test": ["pytest", "hypothesis"],
    },
    entry_points={
        "console_scripts": [
            "tfgc-launch = tfgc.launch:main",
            "tfgc-train = tfgc.train:run",
        ],
    },
    # Placeholder so setuptools runs build_ext (also from `develop` and
    # editable wheels) and tags wheels as platform specific; the actual build
    # is TfgcBuildExt.build_extension. optional=True lets setuptools skip the
    # in-place copy when the library was not built (no TensorFlow).
    ext_modules=[
        Extension(
            EXT_NAME,
            sources=[os.path.relpath(p, ROOT) for p in _cc_sources()],
            optional=True,
        )
    ],
    cmdclass={"build_ext": TfgcBuildExt},
    zip_safe=False,
)
