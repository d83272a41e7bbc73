"""The package's import graph, read statically: no import circle anywhere in tfgc/, and
the wire layer (tfgc.collectives) never reaches a compressor.

Every import statement counts, a function-local one too: a local import that closes a
circle only postpones it. ``from package import name`` is an edge to the submodule when
``name`` is one, else to the package; a module's own parent packages are not edges
(Python imports them first, whatever the module says).
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(root, package="tfgc"):
    """{dotted module name: file path} of every module of ``package`` under ``root``."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def import_graph(root, package="tfgc"):
    """{module: the package's modules it imports}."""
    mods = modules(root, package)
    graph = {}
    for module, path in mods.items():
        edges = set()
        is_package = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = module.split(".")[:len(module.split(".")) - node.level
                                               + (1 if is_package else 0)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != module and not module.startswith(target + "."):
                    edges.add(target)
        graph[module] = edges
    return graph


def circles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_the_graph_is_read(graph):
    # The reader finds edges of every kind it claims to read, or the tests below are empty.
    assert "tfgc.compressors" in graph["tfgc.distribute.cross_device_ops"]
    assert "tfgc.ops.build" in graph["tfgc.ops._loader"]  # a function-local import
    assert "tfgc.collectives.pairwise" in graph["tfgc.collectives.reduce_scatter"]


def test_no_import_circle_in_tfgc(graph):
    assert circles(graph) == []


def test_the_wire_layer_never_reaches_a_compressor(graph):
    for module in graph:
        if module == "tfgc.collectives" or module.startswith("tfgc.collectives."):
            bad = sorted(m for m in reachable(graph, module) if m.startswith("tfgc.compressors")
                         or m.startswith("tfgc.distribute"))
            assert bad == [], f"{module} reaches {bad}"


def test_compressors_know_no_transport(graph):
    for module in graph:
        if module.startswith("tfgc.compressors"):
            bad = sorted(m for m in reachable(graph, module)
                         if m.startswith(("tfgc.collectives", "tfgc.distribute", "tfgc.keras")))
            assert bad == [], f"{module} reaches {bad}"


def test_the_library_never_reaches_the_applications(graph):
    # tfgc.apps (the trainer, the launcher, their data sets and models) sits on top.
    # The top-level package's lazy __getattr__ names it as a string, not an import.
    for module in graph:
        if module != "tfgc" and not module.startswith("tfgc.apps"):
            bad = sorted(m for m in reachable(graph, module) if m.startswith("tfgc.apps"))
            assert bad == [], f"{module} reaches {bad}"
    assert "tfgc.apps.entry_points" in graph["tfgc.apps.train"]


def test_a_circle_and_a_forbidden_edge_are_found(tmp_path):
    # The same reader on a package made to fail: a circle through a local import, and
    # a wire module that imports a compressor.
    pkg = tmp_path / "tfgc"
    for folder in ("", "collectives", "compressors"):
        (pkg / folder).mkdir(exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import tfgc.b\n")
    (pkg / "b.py").write_text("def f():\n    from tfgc import a\n")
    (pkg / "compressors" / "topk.py").write_text("")
    (pkg / "collectives" / "wire.py").write_text("from ..compressors import topk\n")
    g = import_graph(str(tmp_path))
    assert circles(g) == [["tfgc.a", "tfgc.b"]]
    assert "tfgc.compressors.topk" in reachable(g, "tfgc.collectives.wire")

