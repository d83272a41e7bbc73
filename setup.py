"""Packaging for tfgc, including the optional TensorFlow custom-op library.

The C++ ops under custom_ops/cc are compiled against the TensorFlow that is
importable by the Python running this script, into tfgc/ops/_tfgc_ops.so
(next to its loader, so editable installs and in-place builds find it). Any of
these produces it:

    python setup.py build_ext --inplace
    pip install --no-build-isolation -e .
    pip install --no-build-isolation .

A plain `pip install .` or `pip install -e .` builds in pip's isolated
environment, which has no TensorFlow, so nothing is compiled during the
install. The package then carries the sources (tfgc/ops/_csrc for wheels, the
source tree for editable installs), and tfgc compiles the library for the
installed TensorFlow the first time an op runs, into a per-user cache (see
tfgc/ops/build.py, which also holds the compile logic used here, and
`python -m tfgc.ops.build`).

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

import importlib.util
import os
import shutil
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "tfgc.ops._tfgc_ops"
LIB_PATH = os.path.join(ROOT, "tfgc", "ops", "_tfgc_ops.so")
OBJ_ROOT = os.path.join(ROOT, "build", "tfgc_ops")


def _load_build_module():
    # The compile logic lives in the package (tfgc/ops/build.py) because the
    # loader also runs it at first use. Loaded by path: importing the tfgc
    # package here would need its dependencies, which pip's isolated build
    # environment does not have.
    path = os.path.join(ROOT, "tfgc", "ops", "build.py")
    spec = importlib.util.spec_from_file_location("_tfgc_ops_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build = _load_build_module()
_warn = _build._print_warning  # pylint: disable=protected-access


def build_custom_ops(jobs=2, force=False):
    """Builds tfgc/ops/_tfgc_ops.so; returns its path, or None if skipped."""
    if _build.falsy(os.environ.get("TFGC_BUILD_CUSTOM_OPS", "1")):
        _warn("TFGC_BUILD_CUSTOM_OPS=0: not building the custom-op library now; "
              "tfgc will compile it at first use (or run `python -m tfgc.ops.build`).")
        return None
    if not _build.cc_sources(ROOT):
        return None

    info, err = _build.tensorflow_build_info()
    if info is None:
        # The usual case under pip's default build isolation: the build
        # environment has setuptools but not TensorFlow.
        _warn(
            "TensorFlow cannot be imported by the Python running this build "
            f"({sys.executable}): {err}\n"
            "This is expected with pip's build isolation. The custom-op library is "
            "not built now; tfgc compiles it for the installed TensorFlow the first "
            "time an op runs (into ~/.cache/tfgc, once per TensorFlow version), or "
            "ahead of time with\n  python -m tfgc.ops.build\n"
            "To build it during the install instead, install TensorFlow first and use\n"
            "  pip install --no-build-isolation ."
        )
        return None
    try:
        return _build.build_library(ROOT, LIB_PATH, OBJ_ROOT, info, jobs=jobs, force=force)
    except _build.BuildError as exc:
        raise RuntimeError(f"tfgc: {exc} (see above)") from exc


class TfgcBuildPy(build_py):
    """build_py that also ships the C++/CUDA sources of the ops in the package.

    They go to tfgc/ops/_csrc/custom_ops/cc, where the loader finds them to
    compile the library at first use when the install could not (no
    TensorFlow in pip's isolated build). Editable installs read them from the
    source tree instead.
    """

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest_root = os.path.join(self.build_lib, "tfgc", "ops", "_csrc")
        for src in _build.all_source_files(ROOT):
            dest = os.path.join(dest_root, os.path.relpath(src, ROOT))
            self.mkpath(os.path.dirname(dest))
            self.copy_file(src, dest)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        dest_root = os.path.join(self.build_lib, "tfgc", "ops", "_csrc")
        return outputs + [os.path.join(dest_root, os.path.relpath(src, ROOT))
                          for src in _build.all_source_files(ROOT)]


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

    def get_source_files(self):
        # What sdist ships: the headers and CUDA files too, not only the .cc
        # files (older setuptools leave out Extension.depends).
        files = super().get_source_files()
        for ext in self.extensions:
            files += [p for p in ext.depends if p not in files]
        return files

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
        "test": ["pytest", "pytest-xdist", "hypothesis"],
    },
    entry_points={
        "console_scripts": [
            "tfgc-launch = tfgc.apps.launch:main",
            "tfgc-train = tfgc.apps.train:run",
        ],
    },
    # Placeholder so setuptools runs build_ext (also from `develop` and
    # editable wheels) and tags wheels as platform specific; the actual build
    # is TfgcBuildExt.build_extension. optional=True lets setuptools skip the
    # in-place copy when the library was not built (no TensorFlow).
    ext_modules=[
        Extension(
            EXT_NAME,
            sources=[os.path.relpath(p, ROOT) for p in _build.cc_sources(ROOT)],
            # Headers and CUDA files: listed so that source distributions carry them.
            depends=[os.path.relpath(p, ROOT) for p in _build.all_source_files(ROOT)
                     if p not in _build.cc_sources(ROOT)],
            optional=True,
        )
    ],
    cmdclass={"build_ext": TfgcBuildExt, "build_py": TfgcBuildPy},
    zip_safe=False,
)
