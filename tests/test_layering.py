"""The package's layers import only downward: ops -> parallel -> shm -> passes -> compile -> inspect
-> sim.

A module may import from its own layer and the layers below it, never from a layer above, at
module level or inside a function (a function-level import hides a loop; it does not remove it).
``fcoll/__init__.py``, ``fcoll/launch.py`` and ``fcoll/testing.py`` sit on top and may import
anything. See docs/design.md, "Layers".
"""

from __future__ import annotations

import ast
import pathlib

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
