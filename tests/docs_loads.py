"""The loads of the documentation's examples, and whether each checks what it loaded (for test_docs_examples).

While a page runs, :class:`LoadRecorder` wraps every call that loads a checkpoint into a state: torch's
``dcp.load``, ``dcp_cloud.load`` and ``CheckpointManager.load`` (a manager's ``.load``; loads through a
``SafetensorsReader`` or any other reader are ``dcp.load`` calls). For each call made by a block's code it
records where the call is and what the load did to the state it was given: every tensor of it (model and
optimizer state dicts, ``Stateful`` objects through their ``state_dict``, DTensors by their local shard)
before and after. :func:`load_problems` then holds each call to the rule of the documentation test:

* the state held other values: a load that leaves a tensor of it as it was (a load into the model's own
  tensors, into a state loaded before) proves nothing about that tensor;
* the block asserts on the loaded state: an ``assert``, an ``assert_*`` call or an ``if ...: raise
  AssertionError`` after the call (or around it) names a variable the call's state came from, outside the
  call itself; or the block names a ``check=`` that compares the whole state;
* every call of the blocks that looks like a load (``X.load(...)``) ran, through one of the wrapped loaders
  (but one where the code expects an error, in a ``try`` or a ``pytest.raises``: a reader's constructor may
  raise before the load is called).

A load that raised (an example of an error) and a ``CheckpointManager.load`` that found no step to resume
from (it returns None and reads nothing) load nothing, so nothing is asked of them.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

#: Receivers of ``.load(...)`` calls that load no checkpoint into a state.
NOT_CHECKPOINT_LOADS = frozenset({"json", "pickle", "torch", "yaml", "np", "numpy"})


@dataclass(frozen=True)
class LoadCall:
    """One load a block made."""

    #: The code name of the block (its ``page:line``, or the module file of a pytest block).
    source: str
    #: Line of the call in the block's code (1: its first line).
    line: int
    kind: str
    #: ``"loaded"``, ``"raised"``, or ``"nothing"`` (a manager with no step to resume from).
    outcome: str
    #: Tensors of the state that held the loaded values already (names as paths in the state).
    unchanged: tuple[str, ...] = ()
    #: Values of the state the load changed (or created).
    changed: int = 0


def _flatten(obj: Any, path: str, out: dict[str, Any], depth: int = 0) -> None:
    """Copy every value of ``obj`` into ``out`` by its path (tensors by their local data)."""
    import torch

    if depth > 32:
        return
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        out[path] = local.detach().clone()
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _flatten(value, f"{path}.{key}" if path else str(key), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{path}[{i}]", out, depth + 1)
    elif callable(getattr(obj, "state_dict", None)):
        _flatten(obj.state_dict(), path, out, depth + 1)
    else:
        try:
            out[path] = copy.deepcopy(obj)
        except Exception:  # noqa: BLE001 - an uncopyable value is compared by its repr
            out[path] = repr(obj)


def snapshot(state: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _flatten(state, "", out)
    return out


def _as_bytes(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_as_bytes(a), _as_bytes(b))  # bit for bit: NaNs alike, -0.0 unlike 0.0
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared count as changed
        return False


def compare(before: dict[str, Any], after: dict[str, Any]) -> tuple[tuple[str, ...], int]:
    """(tensors that kept their values, values that changed or appeared) from ``before`` to ``after``."""
    import torch

    unchanged = tuple(
        path
        for path, value in before.items()
        if isinstance(value, torch.Tensor) and value.numel() and path in after and _same(value, after[path])
    )
    changed = sum(1 for path, value in after.items() if path not in before or not _same(before[path], value))
    return unchanged, changed


class LoadRecorder:
    """Wraps the loaders while :meth:`installed`; :attr:`calls` are the loads made by code named in ``sources``."""

    def __init__(self, sources: set[str]) -> None:
        self.sources = set(sources)
        self.calls: list[LoadCall] = []
        self._local = threading.local()

    def _site(self) -> tuple[str, int] | None:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename in self.sources:
                return frame.f_code.co_filename, frame.f_lineno
            frame = frame.f_back
        return None

    def _wrap(self, kind: str, fn: Callable[..., Any], state_of: Callable[[tuple, dict], Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def load(*args: Any, **kwargs: Any) -> Any:
            site = None if getattr(self._local, "inside", False) else self._site()
            if site is None:  # a load inside another one, or not made by a block
                return fn(*args, **kwargs)
            state = state_of(args, kwargs)
            before = snapshot(state)
            self._local.inside = True
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                self.calls.append(LoadCall(*site, kind, "raised"))
                raise
            finally:
                self._local.inside = False
            if kind == "CheckpointManager.load" and result is None:
                self.calls.append(LoadCall(*site, kind, "nothing"))
            else:
                unchanged, changed = compare(before, snapshot(state))
                self.calls.append(LoadCall(*site, kind, "loaded", unchanged, changed))
            return result

        return load

    @contextlib.contextmanager
    def installed(self) -> Iterator[LoadRecorder]:
        import torch.distributed.checkpoint as dcp

        import dcp_cloud
        from dcp_cloud import CheckpointManager

        def first(name: str, index: int = 0) -> Callable[[tuple, dict], Any]:
            return lambda args, kwargs: args[index] if len(args) > index else kwargs.get(name)

        patches = [
            (dcp, "load", self._wrap("dcp.load", dcp.load, first("state_dict"))),
            (dcp_cloud, "load", self._wrap("dcp_cloud.load", dcp_cloud.load, first("state_dict"))),
            (
                CheckpointManager,
                "load",
                self._wrap("CheckpointManager.load", CheckpointManager.load, first("state", 1)),
            ),
        ]
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
        try:
            for owner, name, wrapper in patches:
                setattr(owner, name, wrapper)
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


# --------------------------------------------------------------------------
# What the block's code says about a load


def _callee(node: ast.Call) -> tuple[str | None, str | None]:
    """(receiver, name) of a call: ``dcp.load(...)`` -> ("dcp", "load"), ``load(...)`` -> (None, "load")."""
    func = node.func
    if isinstance(func, ast.Attribute):
        receiver = func.value.id if isinstance(func.value, ast.Name) else None
        return receiver, func.attr
    if isinstance(func, ast.Name):
        return None, func.id
    return None, None


def _may_fail(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether ``node`` is where the code expects an error: in the body of a ``try`` that catches one, or in
    a ``with pytest.raises(...)``."""
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, ast.Try) and parent.handlers and child in parent.body:
            return True
        if isinstance(parent, ast.With) and any("raises" in ast.unparse(item.context_expr) for item in parent.items):
            return True
        child, parent = parent, parents.get(id(parent))
    return False


def load_sites(code: str) -> list[int]:
    """Lines of the calls in ``code`` that look like checkpoint loads and must run (the code expects no error
    there: an example of an error may fail before its load is called, in a reader's constructor)."""
    tree = ast.parse(code)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            receiver, name = _callee(node)
            if name == "load" and receiver not in NOT_CHECKPOINT_LOADS and not _may_fail(node, parents):
                sites.append(node.lineno)
    return sorted(sites)


def _the_call(tree: ast.AST, line: int) -> ast.Call | None:
    """The innermost load-like call spanning ``line``."""
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node)[1] == "load":
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                if found is None or node.lineno >= found.lineno:
                    found = node
    return found


def _checks(tree: ast.AST) -> Iterator[ast.AST]:
    """The assertions of ``tree``: ``assert``, ``assert_*(...)`` calls, and the tests of ``if``s that raise
    AssertionError."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            yield node
        elif isinstance(node, ast.Call) and (_callee(node)[1] or "").startswith("assert"):
            yield node
        elif isinstance(node, ast.If) and any(
            isinstance(n, ast.Raise) and "AssertionError" in ast.unparse(n.exc or n) for n in node.body
        ):
            yield node.test


def asserted_names(code: str, line: int) -> tuple[set[str], set[str]] | None:
    """(names the load at ``line`` takes its state from, those of them an assertion after it names outside the
    call); None where no load-like call spans ``line`` (a loader reached under another name)."""
    tree = ast.parse(code)
    call = _the_call(tree, line)
    if call is None:
        return None
    state = (
        call.args[0] if call.args else next((k.value for k in call.keywords if k.arg in ("state_dict", "state")), None)
    )
    names = {n.id for n in ast.walk(state) if isinstance(n, ast.Name)} if state is not None else set()
    inside = {id(n) for n in ast.walk(call)}
    named: set[str] = set()
    for check in _checks(tree):
        if (getattr(check, "end_lineno", None) or check.lineno) < call.lineno:
            continue
        named |= {n.id for n in ast.walk(check) if isinstance(n, ast.Name) and id(n) not in inside}
    return names, names & named


@dataclass(frozen=True)
class Block:
    """What :func:`load_problems` needs of a block."""

    #: The code name the block ran under (see :attr:`LoadCall.source`).
    source: str
    page: str
    #: Line of the page just above the block's first line of code.
    offset: int
    code: str
    #: Whether a ``check=`` compares what the block loaded.
    checked: bool = False


def load_problems(calls: list[LoadCall], blocks: list[Block]) -> list[str]:
    """Every way ``calls`` (made while ``blocks`` ran) break the rule of the module docstring, one line each."""
    by_source = {b.source: b for b in blocks}
    ran: set[tuple[str, int]] = set()
    found: set[tuple[str, int, str]] = set()
    for call in calls:
        block = by_source[call.source]
        ran.add((call.source, call.line))
        if call.outcome != "loaded":
            continue
        at = (block.page, block.offset + call.line)
        if call.unchanged:
            shown = ", ".join(call.unchanged[:4]) + (", ..." if len(call.unchanged) > 4 else "")
            found.add((*at, f"{call.kind} into a state that held the loaded values already ({shown})"))
        elif not call.changed:
            found.add((*at, f"{call.kind} changed nothing in the state it loaded into"))
        if block.checked:
            continue
        names = asserted_names(block.code, call.line)
        if names is None:
            found.add((*at, f"{call.kind} from a line that holds no load call this test can read"))
        elif not names[1]:
            found.add((*at, f"{call.kind} into {sorted(names[0]) or 'a state'}, and no assertion after it names it"))
    for block in blocks:
        for line in load_sites(block.code):
            if (block.source, line) not in ran:
                found.add((block.page, block.offset + line, "a load that never ran through a loader this test wraps"))
    return [f"{page}:{line}: {what}" for page, line, what in sorted(found)]


__all__ = ["Block", "LoadCall", "LoadRecorder", "asserted_names", "load_problems", "load_sites", "snapshot"]
