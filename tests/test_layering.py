"""The package's import graph: layers import only downward, no module imports itself back, and no
module imports another's private names.

Layers: ops -> parallel -> shm -> passes -> compile -> inspect -> sim. A module may import from
its own layer and the layers below it, never from a layer above, at module level or inside a
function (a function-level import hides a loop; it does not remove it). ``fcoll/__init__.py``,
``fcoll/launch.py``, ``fcoll/mps.py``, ``fcoll/calibrate.py`` and the ``fcoll/testing`` package
sit on top and may import anything. Inside and across layers the modules form no cycle
(module-level, function-level and ``TYPE_CHECKING`` imports all count: each is a dependency a
reader has to follow), and a ``_private`` name stays in its module (make it public and
documented, or move it). See docs/design.md, "Layers".
"""

from __future__ import annotations

import ast
import pathlib
import sys

import fcoll

LAYERS = ("ops", "parallel", "shm", "passes", "compile", "inspect", "sim")
PACKAGE = pathlib.Path(fcoll.__file__).parent


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "fcoll" or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported fcoll module) of every import statement in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.startswith("fcoll")]


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = "fcoll." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        own = _layer(module)
        if own is None:
            continue
        for line, name in _imports(path):
            target = _layer(name)
            if target is not None and target > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} "
                              f"({LAYERS[own]} -> {LAYERS[target]})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_every_layer_is_a_package():
    for name in LAYERS:
        assert (PACKAGE / name / "__init__.py").is_file(), f"fcoll/{name} is not a package"


def _modules() -> dict[str, pathlib.Path]:
    """Every module of fcoll by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("fcoll", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str, int]]]:
    """(module -> the fcoll modules it imports, private imports as (importer, module, name,
    line)). Every import statement counts, wherever it stands; ``from pkg import name`` where
    ``name`` is a submodule imports the submodule; relative imports are resolved."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    private = []
    for module, path in modules.items():
        found: set[str] = set()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in modules:
                        found.add(sub)
                        continue
                    found.add(base)
                    if (base in modules and a.name.startswith("_")
                            and not a.name.startswith("__")):
                        private.append((module, base, a.name, node.lineno))
        edges[module] = {m for m in found if m in modules and m != module}
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_cycle_finder_sees_every_kind_of_import():
    """The checker itself: a circle made of a function-level import or a submodule named in a
    ``from`` import is found, and a chain is not a cycle."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_fcoll_modules():
    edges, _ = _graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles (module-level, function-level or TYPE_CHECKING):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_a_private_name_of_another():
    _, private = _graph()
    bad = [f"{m}:{line} imports {name} from {src}" for m, src, name, line in private]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_shm_folder_map_names_every_module():
    """``fcoll/shm/__init__.py``'s docstring is the backend's map: it names every module."""
    import fcoll.shm

    doc = fcoll.shm.__doc__
    missing = [m for m in _modules() if m.startswith("fcoll.shm.")
               and f"``{m.rsplit('.', 1)[1]}``" not in doc
               and f"``{m.rsplit('.', 1)[1]}/``" not in doc]
    assert not missing, f"modules missing from fcoll/shm/__init__.py's folder map: {missing}"
