"""The package's layers import only downward (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "orbit_pt"

# Lowest first. A module may import modules of its own layer or of a lower one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("orbit_pt.errors", "orbit_pt._version")),
    ("control", ("orbit_pt._control",)),
    ("format", ("orbit_pt._format",)),
    ("storage", ("orbit_pt._storage", "orbit_pt.metadata")),
    ("handlers", ("orbit_pt.handlers", "orbit_pt.recipe")),
    ("tiers", ("orbit_pt._tiers",)),
    (
        "manager",
        ("orbit_pt.manager", "orbit_pt.options", "orbit_pt.policies", "orbit_pt.retention"),
    ),
    (
        "tools",
        (
            "orbit_pt.verify",
            "orbit_pt.export",
            "orbit_pt.pretrained",
            "orbit_pt.cli",
            "orbit_pt.__main__",
        ),
    ),
    ("api", ("orbit_pt",)),
]


def _layer(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest prefix wins
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or module.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from orbit_pt import _x` / `from orbit_pt._format import checksum` name modules.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "orbit_pt" or name.startswith("orbit_pt.")}


def _real_module(name: str) -> str:
    """``name`` if it is a module or package of orbit_pt, else its parent (an imported name)."""
    relative = Path(*name.split("."))
    if (PACKAGE.parent / relative).with_suffix(".py").exists():
        return name
    if (PACKAGE.parent / relative / "__init__.py").exists():
        return name
    return name.rpartition(".")[0]


def test_every_module_imports_only_its_own_layer_or_lower() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        own = _layer(module)
        for imported in sorted(_imports(path, module)):
            target = _real_module(imported)
            if target == "orbit_pt" and module != "orbit_pt":
                continue  # `from orbit_pt import _x` resolves to the submodule, checked above
            if _layer(target) > own:
                wrong.append(
                    f"{module} ({LAYERS[own][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
                )
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_every_module_is_in_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        _layer(_module_name(path))
