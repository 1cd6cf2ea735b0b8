"""The package's layering, read from the source: every import of a quantpress module (at module
level or inside a function) goes to the same layer or a lower one, and no module imports
another module's private names."""
from __future__ import annotations

import ast
from pathlib import Path

import quantpress

PACKAGE = Path(quantpress.__file__).resolve().parent
#: bottom to top; a module may import from its own layer and the layers below
LAYERS = {"errors": 0, "runtime": 0, "assets": 0, "configs": 0, "quantize": 1, "calibration": 2,
          "convert": 3, "targets": 4, "batch": 4, "cli": 5, "__main__": 5, "__init__": 5}


def _layer(module: str) -> int:
    parts = module.split(".")
    assert parts[0] == "quantpress", module
    return LAYERS[parts[1]] if len(parts) > 1 else LAYERS["__init__"]


def _modules():
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, f, ast.parse(f.read_text(encoding="utf-8"))


def _imports(name: str, tree: ast.AST):
    pkg = name if (PACKAGE.parent / Path(*name.split("."))).is_dir() else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod, [a.name for a in node.names]


def test_every_layer_imports_only_below_itself():
    bad = []
    for name, f, tree in _modules():
        if name == "quantpress":
            continue
        mine = _layer(name)
        for line, mod, _ in _imports(name, tree):
            if mod.split(".")[0] == "quantpress" and mod != "quantpress" and _layer(mod) > mine:
                bad.append(f"{f.relative_to(PACKAGE.parent)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_private_names_imported():
    bad = []
    for name, f, tree in _modules():
        for line, mod, names in _imports(name, tree):
            if mod.startswith("quantpress"):
                for n in names:
                    if n.startswith("_") and not n.startswith("__"):
                        bad.append(f"{f.relative_to(PACKAGE.parent)}:{line} imports {mod}.{n}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_violation(tmp_path):
    """The checker itself: an upward import and a private name are found."""
    tree = ast.parse("from quantpress.targets.base import produce\nfrom quantpress.runtime import _libc\n")
    found = list(_imports("quantpress.calibration.engine", tree))
    assert [(m, n) for _, m, n in found] == [("quantpress.targets.base", ["produce"]),
                                            ("quantpress.runtime", ["_libc"])]
    assert _layer("quantpress.targets.base") > _layer("quantpress.calibration.engine")
