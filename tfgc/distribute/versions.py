"""The TensorFlow and Keras versions whose private names tfgc was checked against.

The strategy subclasses TensorFlow's ``CollectiveAllReduceExtended`` and
``CollectiveAllReduce`` and reads a few of their private members; the Keras hooks wrap
private methods of tf-keras's and Keras 3's optimizers and trainers. Those names move
between releases without notice, so importing the strategy compares the installed
versions with the ranges below and warns once, naming both, when one is outside: the
first symptom of a renamed internal is otherwise an AttributeError deep inside a
training step.
"""

import importlib.metadata
import warnings

# (distribution, first version checked, first version not checked), per major.minor.
CHECKED = (
    ("tensorflow", (2, 21), (2, 22)),
    ("tf-keras", (2, 21), (2, 22)),
    ("keras", (3, 15), (3, 16)),
)
# The CPU and CUDA builds of TensorFlow install under these names.
_TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-intel")

_warned = False


def _installed(distribution):
    names = _TENSORFLOW_DISTRIBUTIONS if distribution == "tensorflow" else (distribution,)
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _major_minor(version):
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts + [0] * (2 - len(parts)))


def unchecked(installed=None):
    """The (distribution, installed version, checked range) outside the checked ranges.

    ``installed`` maps distributions to versions (default: what is installed); a
    distribution that is not installed is not reported (Keras 3 and tf-keras are each
    optional).
    """
    out = []
    for distribution, low, high in CHECKED:
        version = (installed or {}).get(distribution) if installed is not None \
            else _installed(distribution)
        if version is None:
            continue
        if not low <= _major_minor(version) < high:
            out.append((distribution, version,
                        f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"))
    return out


def warn_if_unchecked(installed=None):
    """Warns once per process when an installed version is outside the checked ranges."""
    global _warned
    if _warned:
        return False
    outside = unchecked(installed)
    if not outside:
        return False
    _warned = True
    listed = "; ".join(f"{name} {version} (checked: {checked})"
                       for name, version, checked in outside)
    warnings.warn(
        f"tfgc was checked against other versions than the installed {listed}. tfgc "
        "relies on private TensorFlow and Keras names (tfgc/distribute/versions.py); if "
        "training fails inside tfgc, install the checked versions.",
        RuntimeWarning, stacklevel=3)
    return True
