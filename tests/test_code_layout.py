"""The shape of the package: dependencies that point one way (strategy → change → the layers under it), no import
circle anywhere (imports under ``TYPE_CHECKING`` and inside functions count too: a helper typed on a module still
reaches into it), and no file over :data:`MAX_LINES` lines.

Files still over the limit are listed in :data:`OVER_THE_LIMIT` with the most lines they may have: the list only
shrinks (a listed file that drops under the limit must leave it, and none may grow) — issue 35's ratchet.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_emig"
MAX_LINES = 500
OVER_THE_LIMIT: dict[str, int] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    found = set()
    for target in targets:
        while target and target not in modules:  # a name imported from a module: the module
            target = target.rsplit(".", 1)[0] if "." in target else ""
        if target.startswith("lightning_emig") and target != name:
            found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_module_of_the_package_imports_itself_back_through_others() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_file_is_over_the_limit_and_the_listed_ones_only_shrink() -> None:
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    over = {name: n for name, n in lengths.items() if n > MAX_LINES}
    grown = {name: (n, OVER_THE_LIMIT.get(name, MAX_LINES)) for name, n in over.items()
             if n > OVER_THE_LIMIT.get(name, MAX_LINES)}
    assert not grown, f"over {MAX_LINES} lines (or over their recorded size): {grown}"
    shrunk = sorted(set(OVER_THE_LIMIT) - set(over))
    assert not shrunk, f"now within {MAX_LINES} lines: take them off OVER_THE_LIMIT: {shrunk}"


#: Packages below the strategy, and what none of their modules may import (imports anywhere in a file count):
#: the strategy (Lightning's adapter) uses ``change``, which uses the layers under it; never the other way round.
NEVER_IMPORTED_FROM = {
    "lightning_emig.change": ("lightning_emig.strategy",),
    "lightning_emig.migration": ("lightning_emig.strategy", "lightning_emig.change"),
    "lightning_emig.membership": ("lightning_emig.strategy", "lightning_emig.change"),
    "lightning_emig.launcher": ("lightning_emig.strategy", "lightning_emig.change"),
    "lightning_emig.layout": ("lightning_emig.strategy", "lightning_emig.change"),
}


def _upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    def within(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    return sorted((module, target) for module, targets in graph.items() for target in targets
                  for package, above in NEVER_IMPORTED_FROM.items() if within(module, package)
                  if any(within(target, a) for a in above))


def test_dependencies_point_down_from_the_strategy_to_the_change_and_the_layers_under_it() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"lightning_emig.change.requests": {"lightning_emig.strategy.elastic"},
             "lightning_emig.strategy.elastic": {"lightning_emig.change.requests"}}
    assert _upward_imports(graph) == [("lightning_emig.change.requests", "lightning_emig.strategy.elastic")]
