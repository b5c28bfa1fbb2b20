"""No import cycles among the package's modules, deferred imports (inside functions)
included: data flows one way, from the codec up to the user-facing functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "deltacells"


def import_graph() -> dict[str, set[str]]:
    """Module name -> the package's modules it imports, at any depth of its code."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {p.stem for p in PACKAGE.glob("*.pyx")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == "deltacells" and len(parts) > 1:
                    found.add(parts[1])
                elif parts[0] == "deltacells":  # from deltacells import _kernels, ...
                    found |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "deltacells" and len(parts) > 1:
                        found.add(parts[1])
        found.discard(path.stem)
        graph[path.stem] = found & modules
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each reported from where it closes)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_deferred_ones_included():
    graph = import_graph()
    assert "writer" in graph and "codec" in graph["writer"]  # the graph is really read
    assert cycles({k: v - {"__init__"} for k, v in graph.items()}) == []
