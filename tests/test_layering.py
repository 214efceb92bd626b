"""The package layering, read from the source: which package may import which, and no import cycles.

Every import of every module in ``dcp_cloud/`` is parsed (absolute and relative, at module level, in
functions, under ``TYPE_CHECKING``) and resolved to the ``dcp_cloud`` module it names. The layers, bottom
up: ``errors`` and ``config``; ``store/`` (knows nothing of checkpoints) and ``uri`` (which asks
``store/azure`` whether a container name is valid); ``transfer/`` (moves bytes); ``format/`` (the on-store
contract); ``planner/`` (pure); ``locations/`` (a URI and its cloud's options become a store); ``dcp/``
(the DCP adapter: ``device/`` below ``save/`` and ``load/``, which do not import each other); then
``run/``, ``maintenance/``, ``safetensors/``, ``integrations/``, ``cli/``, ``testing/``.
A cycle is looked for among the imports that run when a module is imported (not those in functions or
under ``TYPE_CHECKING``).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dcp_cloud

ROOT = Path(dcp_cloud.__file__).parent

#: package -> packages it must not import (any import: module level or in a function).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "dcp_cloud.format": (
        "dcp_cloud.dcp", "dcp_cloud.planner", "dcp_cloud.locations", "dcp_cloud.run", "dcp_cloud.maintenance",
        "dcp_cloud.safetensors", "dcp_cloud.cli", "dcp_cloud.testing",
    ),
    "dcp_cloud.planner": ("dcp_cloud.store", "dcp_cloud.transfer", "dcp_cloud.dcp"),
    # store/ imports errors and config (RetryConfig, cpu_share) and nothing else of dcp_cloud.
    "dcp_cloud.store": (
        "dcp_cloud.dcp", "dcp_cloud.format", "dcp_cloud.transfer", "dcp_cloud.planner", "dcp_cloud.run",
        "dcp_cloud.maintenance", "dcp_cloud.safetensors", "dcp_cloud.cli", "dcp_cloud.testing",
    ),
    "dcp_cloud.transfer": ("dcp_cloud.dcp", "dcp_cloud.locations"),
    # The one place a URI becomes a store sits below everything that takes a URI.
    "dcp_cloud.locations": (
        "dcp_cloud.dcp", "dcp_cloud.format", "dcp_cloud.planner", "dcp_cloud.run", "dcp_cloud.maintenance",
        "dcp_cloud.safetensors", "dcp_cloud.cli", "dcp_cloud.testing",
    ),
    "dcp_cloud.dcp": ("dcp_cloud.maintenance", "dcp_cloud.testing", "dcp_cloud.run", "dcp_cloud.cli"),
    # The two sides of the adapter do not reach into each other; device staging serves both.
    "dcp_cloud.dcp.save": ("dcp_cloud.dcp.load",),
    "dcp_cloud.dcp.load": ("dcp_cloud.dcp.save",),
    "dcp_cloud.dcp.device": ("dcp_cloud.dcp.save", "dcp_cloud.dcp.load"),
    # Integrations (the switch for dcp.save's checkpoint_id, the fsspec filesystem) sit on top of the
    # adapter and the stores; nothing below them knows they exist.
    "dcp_cloud.integrations": ("dcp_cloud.run", "dcp_cloud.maintenance", "dcp_cloud.cli", "dcp_cloud.testing"),
}  # fmt: skip
for _below in ("dcp_cloud.store", "dcp_cloud.transfer", "dcp_cloud.format", "dcp_cloud.planner",
               "dcp_cloud.locations", "dcp_cloud.dcp", "dcp_cloud.run", "dcp_cloud.maintenance",
               "dcp_cloud.safetensors"):  # fmt: skip
    FORBIDDEN[_below] = (*FORBIDDEN.get(_below, ()), "dcp_cloud.integrations")

#: package -> the only dcp_cloud packages and modules it may import (besides its own).
ONLY: dict[str, tuple[str, ...]] = {
    "dcp_cloud.format": (
        "dcp_cloud.store", "dcp_cloud.transfer", "dcp_cloud.errors", "dcp_cloud.config", "dcp_cloud.uri",
    ),
    "dcp_cloud.planner": ("dcp_cloud.format", "dcp_cloud.errors", "dcp_cloud.config"),
}  # fmt: skip


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the dcp_cloud module imported
    line: int
    #: Run when the importing module is imported (not in a function, not under TYPE_CHECKING).
    eager: bool


def _module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        name, is_pkg = _module_name(path)
        out[name] = (path, is_pkg)
    return out


MODULES = _modules()


def _resolve(current: str, is_pkg: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    parts = current.split(".") if is_pkg else current.split(".")[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + (module.split(".") if module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, eager: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, False)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, False
                yield from _walk(stmt, False)
            for stmt in child.orelse:
                yield stmt, eager
                yield from _walk(stmt, eager)
        else:
            yield child, eager
            yield from _walk(child, eager)


def imports_of(name: str, path: Path, is_pkg: bool) -> list[Import]:
    """The dcp_cloud modules ``name`` imports: ``from pkg import sub`` names ``pkg.sub`` where it is a module."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node, eager in _walk(tree, True):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_pkg, node.level, node.module)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == "dcp_cloud" or target.startswith("dcp_cloud."):
                assert target in MODULES, f"{path}:{node.lineno} imports {target}, which is not a module"
                out.append(Import(name, target, node.lineno, eager))
    return out


IMPORTS = [imp for name, (path, is_pkg) in MODULES.items() for imp in imports_of(name, path, is_pkg)]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _where(imp: Import) -> str:
    return f"{MODULES[imp.source][0].relative_to(ROOT.parent)}:{imp.line} imports {imp.target}"


def violations(imports: list[Import], package: str) -> list[str]:
    """Every import from inside ``package`` that breaks its rules in FORBIDDEN or ONLY."""
    bad = []
    forbidden, allowed = FORBIDDEN.get(package, ()), ONLY.get(package)
    for imp in imports:
        if not _within(imp.source, package) or _within(imp.target, package):
            continue
        if any(_within(imp.target, f) for f in forbidden):
            bad.append(f"{_where(imp)} ({package} must not import {', '.join(forbidden)})")
        if allowed is not None and not any(_within(imp.target, a) for a in allowed):
            bad.append(f"{_where(imp)} ({package} may import only {', '.join(allowed)})")
    return bad


def find_cycle(imports: list[Import]) -> list[str] | None:
    """A cycle of eager imports between dcp_cloud modules (as ``[a, b, ..., a]``), or None."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.eager and imp.target != imp.source:
            graph.setdefault(imp.source, set()).add(imp.target)
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if color.get(start, WHITE) != WHITE:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph.get(start, ()))))]
        color[start] = GREY
        path = [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                color[node] = BLACK
                continue
            state = color.get(child, WHITE)
            if state == GREY:
                return path[path.index(child) :] + [child]
            if state == WHITE:
                color[child] = GREY
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_the_imports_are_seen() -> None:
    """Sanity: relative, absolute, function-level and submodule imports are all found."""
    found = {(imp.source, imp.target, imp.eager) for imp in IMPORTS}
    assert ("dcp_cloud.dcp.load.reader", "dcp_cloud.format.layout", True) in found  # from ...format.layout
    assert ("dcp_cloud.dcp.save.writer", "dcp_cloud.format.framing", True) in found  # from ...format import framing
    assert ("dcp_cloud.locations.locate", "dcp_cloud.store.s3.config", False) in found  # in a function
    assert (
        "dcp_cloud",
        "dcp_cloud.dcp.constructors.s3",
        True,
    ) in found  # from .dcp.constructors.s3, in a package's __init__
    assert len(MODULES) > 100 and len(IMPORTS) > 300


def test_no_import_cycle() -> None:
    cycle = find_cycle(IMPORTS)
    assert cycle is None, "import cycle (module-level imports): " + " -> ".join(cycle)


@pytest.mark.parametrize("package", sorted(set(FORBIDDEN) | set(ONLY)))
def test_package_imports_only_below_it(package: str) -> None:
    assert any(_within(name, package) for name in MODULES), f"{package} has no modules: update the rules"
    bad = violations(IMPORTS, package)
    assert not bad, "\n".join(bad)


def test_the_rules_catch_what_they_forbid() -> None:
    """A forbidden import and a cycle, made up, are reported (the checks above are not vacuous)."""
    made_up = [
        Import("dcp_cloud.format.layout", "dcp_cloud.dcp.base", 1, True),
        Import("dcp_cloud.planner.load", "dcp_cloud.store.protocol", 1, False),
        Import("dcp_cloud.dcp.device.staging", "dcp_cloud.dcp.save.writer", 1, False),
    ]
    assert len(violations(made_up, "dcp_cloud.format")) == 2  # forbidden, and not among the allowed
    assert len(violations(made_up, "dcp_cloud.planner")) == 2  # likewise
    assert len(violations(made_up, "dcp_cloud.dcp.device")) == 1
    assert violations(made_up, "dcp_cloud.dcp") == []  # inside dcp/: its own rules do not apply
    looped = [
        Import("dcp_cloud.format.layout", "dcp_cloud.format.footer", 1, True),
        Import("dcp_cloud.format.footer", "dcp_cloud.format.layout", 1, True),
    ]
    assert find_cycle(looped) in (
        ["dcp_cloud.format.footer", "dcp_cloud.format.layout", "dcp_cloud.format.footer"],
        ["dcp_cloud.format.layout", "dcp_cloud.format.footer", "dcp_cloud.format.layout"],
    )
    assert find_cycle([dataclasses.replace(imp, eager=False) for imp in looped]) is None
