"""No import circle in the tree (docs/architecture.md, "Who may import whom"): the module graph of
the project's packages, built from every import statement in the source, function-level ones
included, is acyclic. A function-level import hides a circle from Python's import machinery, not
from the design: the modules still depend on each other, so the checker counts them like any
other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "core", "db", "jobrules", "shardyard", "trainer", "workers")
"""The packages pyproject.toml installs."""


def module_name(path: Path, *, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module of `packages` (under `root`; migrations aside) -> the modules of `packages` it
    imports anywhere in its source. `from a.b import c` counts as importing a.b.c when that is a
    module, else a.b; a module that imports its package imports the package's __init__."""
    files = {
        module_name(p, root=root): p
        for package in packages
        for p in sorted((root / package).rglob("*.py"))
        if "migrations" not in p.relative_to(root).parts
    }
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for target in _imported(name, path, files):
            while target and target not in files:  # `import trainer.x.f` of a name: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _imported(name: str, path: Path, files: dict[str, Path]) -> list[str]:
    """The dotted names one module's import statements name (relative ones made absolute)."""
    is_package = path.name == "__init__.py"
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # relative: from the module's own package (a package's __init__ is its own)
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that returns to its first module) per strongly connected group of more
    than one module, found by depth-first search."""
    found: list[list[str]] = []
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        on_path = {start}
        while stack:
            node, pending = stack[-1]
            if not pending:
                stack.pop()
                on_path.discard(node)
                done.add(node)
                continue
            nxt = pending.pop(0)
            if nxt in on_path:
                path = [n for n, _ in stack]
                found.append([*path[path.index(nxt) :], nxt])
                continue
            if nxt not in done:
                stack.append((nxt, sorted(graph[nxt])))
                on_path.add(nxt)
    return found


def test_the_tree_has_no_import_circle() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 150, f"only {len(graph)} modules found under {', '.join(PACKAGES)}"
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checker_sees_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from pkg.a import g\n    return g\n")
    (pkg / "d.py").write_text("import pkg.a\nimport os\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]
    (pkg / "sub" / "c.py").write_text("def f():\n    return 1\n")
    assert circles(import_graph(tmp_path, ("pkg",))) == []


def test_the_checker_sees_a_circle_across_packages(tmp_path: Path) -> None:
    for pkg, source in (("one", "from two.b import x\n"), ("two", "def x():\n    import one.a\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / ("a.py" if pkg == "one" else "b.py")).write_text(source)
    assert circles(import_graph(tmp_path, ("one", "two"))) == [["one.a", "two.b", "one.a"]]
