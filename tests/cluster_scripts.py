"""What the cluster tests share: the repository, the workers' environment, the scripts."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "TF_CPP_MIN_LOG_LEVEL": "2"}


def cluster_script(name):
    """``(path, module)`` of ``tests/cluster/<name>.py``; the module gives its constants."""
    path = os.path.join(REPO, "tests", "cluster", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"cluster_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module
