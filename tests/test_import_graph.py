"""The package's import graph, read from the source (every import statement, at the top or inside a function): no
circle between modules, and no import from a lower floor to a higher one (LAYERS, low to high).

    python tests/test_import_graph.py        # prints the circles and upward imports, if any
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moestream"
# Floors, low to high: a module's floor is its first name under the package (moestream/arch/names.py: arch).
LAYERS = ["errors", "knobs", "device", "argv", "outputs", "config", "arch", "text", "quant", "kernels", "experts",
          "models", "engine_config", "flags", "loading", "runtime", "serving", "api", "compat", "cli", "tools",
          "server"]


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its __init__.py)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("moestream", *path.relative_to(PACKAGE).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from . import x` counts as x where x is a module)."""
    graph = {}
    for name, path in mods.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods] or [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def floor(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if floor(a) is not None and floor(b) is not None and floor(b) > floor(a))


def test_the_graph_sees_imports_at_the_top_and_inside_functions():
    graph = imports(modules())
    assert "moestream.quant.dequant_iq" in graph["moestream.quant.dequant"]      # at the top
    assert "moestream.kernels.delta_reference" in graph["moestream.kernels.delta"]   # inside pick_delta_kernels
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert circles(imports(modules())) == []


def test_no_import_from_a_lower_floor_to_a_higher_one():
    assert upward(imports(modules())) == []


if __name__ == "__main__":
    g = imports(modules())
    cs, up = circles(g), upward(g)
    print(f"circles {len(cs)}\nupward {len(up)}")
    for c in cs:
        print("  circle:", " <-> ".join(c))
    for a, b in up:
        print("  upward:", a, "->", b)
