"""The import rules of docs/ARCHITECTURE.md, held: layers import only downwards, no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import nanhunt

PKG = Path(nanhunt.__file__).parent

# each layer, and the layers (or leaf modules) it may import; anything else is a violation
LAYERS: dict[str, set[str]] = {
    "nanhunt": {"*"},  # the public surface
    "__main__": {"_cli"},
    "_cli": {"*"},
    "integrations": {"*"},
    "_record": {"_locate", "_report", "_steplog", "_finding", "_words", "_tensors", "_files", "_hooks", "_profile"},
    "_locate": {"_steplog", "_finding", "_words", "_tensors", "_files", "_hooks", "_profile"},
    "_report": {"_finding", "_words", "_files"},
    "_steplog": {"_tensors"},
    "_finding": {"_words"},
    "_words": set(),
    "_tensors": set(),
    "_files": set(),
    "_hooks": set(),
    "_profile": set(),
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every nanhunt module ``name`` imports (also inside functions; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip.update(id(c) for c in ast.walk(n))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.startswith("nanhunt"))
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (n.level - 1)]
                mod = ".".join([*base, n.module] if n.module else base)
            else:
                mod = n.module or ""
            if mod.startswith("nanhunt"):
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in n.names)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nanhunt"


def _resolve(target: str, mods: dict[str, Path]) -> str | None:
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target or None


def test_layers_import_only_what_the_rules_allow() -> None:
    mods = _modules()
    bad = []
    for name, path in mods.items():
        layer = _layer(name)
        assert layer in LAYERS, f"{name}: a module outside every layer of docs/ARCHITECTURE.md"
        allowed = LAYERS[layer]
        for t in _imports(name, path):
            target = _resolve(t, mods)
            if target is None or target == "nanhunt":
                continue
            tl = _layer(target)
            if tl == layer or "*" in allowed or tl in allowed:
                continue
            bad.append(f"{name} imports {target} ({layer} -> {tl})")
    assert not bad, "imports against the layer rules:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    mods = _modules()
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        for t in _imports(m, p):
            target = _resolve(t, mods)
            if target and target != m and not m.startswith(target + ".") and target != "nanhunt":
                edges[m].add(target)
    # depth-first search for a back edge
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(v: str, path: list[str]) -> None:
        state[v] = 1
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                cycles.append(path[path.index(w):] + [w])
            elif w not in state:
                visit(w, [*path, w])
        state[v] = 2

    for v in sorted(mods):
        if v not in state:
            visit(v, [v])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_violation() -> None:
    """The rule test is not vacuous: the hot path does import the analysis, and not the reverse."""
    mods = _modules()
    assert "nanhunt._locate" in {_resolve(t, mods) for t in _imports("nanhunt._record.hunt", mods["nanhunt._record.hunt"])}
    assert "_record" not in LAYERS["_locate"]
