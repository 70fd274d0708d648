"""armserve's modules import each other without cycles: every import counted, at module level or
inside a function (a lazy import hides a cycle from Python, not from a reader)."""

from __future__ import annotations

import ast
import os

import armserve

ROOT = os.path.dirname(armserve.__file__)


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py under armserve/."""
    mods = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
    """The armserve modules `name` imports (a package importing its own parent is not counted)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_armserve_has_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert len(graph) > 40 and graph["armserve.cli"], "the scan found the package"
    assert _cycles(graph) == []
