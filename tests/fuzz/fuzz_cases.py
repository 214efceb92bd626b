"""What one fuzz case is (plain data: it travels to the ranks and into a one-line reproducer), and the
hypothesis strategies that draw cases.

A case is a state dict described leaf by leaf (:class:`Item`): its path in the nested dicts and lists,
what it is (a tensor of some dtype and global shape, a ``BytesIO``, a plain object), how it is laid out
on the ``w1`` saving ranks and, independently, on the ``w2`` loading ranks (:class:`Layout`: a plain
tensor on every rank, a DTensor on a 1-D or 2-D mesh, a legacy ShardedTensor with a chunk or an
enumerable spec), plus one drawn value of every option of the table in :mod:`fuzz_options`. Values
are not stored: every rank derives them from the item's ``seed``.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fuzz_options import OPTIONS, applicable, decode_value, encode_value
from hypothesis import strategies as st

#: dtypes drawn for tensor leaves (every common one).
DTYPES = ("float32", "bfloat16", "float16", "int8", "int32", "int64", "bool", "complex64", "float64", "uint8")
#: Device-mesh shapes per world size (1-D, and 2-D ones, degenerate ones included).
MESHES = {
    1: ((1,), (1, 1)),
    2: ((2,), (1, 2), (2, 1)),
    3: ((3,), (1, 3), (3, 1)),
    4: ((4,), (2, 2), (1, 4), (4, 1)),
}
#: A DTensor placement: -1 is Replicate(), d >= 0 is Shard(d).
REPLICATE = -1


@dataclass(frozen=True)
class Layout:
    """How one tensor's global value is held by the ranks of a save or a load."""

    #: "plain" (the whole tensor on every rank), "dtensor", "chunk" (ChunkShardingSpec) or "enum"
    #: (EnumerableShardingSpec).
    kind: str = "plain"
    #: dtensor: the mesh shape; its ranks are 0..W-1 in row-major order.
    mesh: tuple[int, ...] = ()
    #: dtensor: one placement per mesh dim (REPLICATE or a tensor dim); chunk: the rank of each chunk.
    placements: tuple[int, ...] = ()
    #: chunk: the sharded dim.
    dim: int = 0
    #: enum: (offsets, sizes, rank) of each shard.
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] = ()
    #: Hold the (local) tensors with non-contiguous strides.
    noncontig: bool = False
    #: plain, dtensor: hold the (local) tensors as lazy views whose memory is not their values (complex: a
    #: conjugate bit over the conjugated values; float32/64: a negative bit over the negated values).
    lazy: bool = False


@dataclass(frozen=True)
class Item:
    #: Keys from the root: str for dict keys, int for list positions.
    path: tuple[Any, ...]
    #: "tensor", "bytes" (an io.BytesIO) or "object" (a picklable Python value).
    kind: str
    seed: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    save: Layout = field(default_factory=Layout)
    load: Layout = field(default_factory=Layout)
    #: Incremental cases: the base holds other values of this item.
    changed: bool = False


@dataclass(frozen=True, repr=False)
class Case:
    w1: int
    w2: int
    target: str
    items: tuple[Item, ...]
    #: Drawn options of every scope but "transfer" (name -> value; DEFAULT where left out).
    options: dict[str, Any]
    save_transfer: dict[str, Any]
    load_transfer: dict[str, Any]

    def opt(self, name: str) -> Any:
        return self.options.get(name)

    def __repr__(self) -> str:
        return "Case<" + self.describe().replace("\n", "; ") + ">"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints a falsifying case
        printer.text(repr(self))

    def describe(self) -> str:
        """A readable one-paragraph summary (the reproducer carries the exact case)."""
        lines = [f"w1={self.w1} w2={self.w2} target={self.target}"]
        for what, values in (
            ("options", self.options),
            ("save transfer", self.save_transfer),
            ("load transfer", self.load_transfer),
        ):
            given = {k: v for k, v in sorted(values.items()) if encode_value(v) != "DEFAULT"}
            lines.append(f"{what}: " + (", ".join(f"{k}={v!r}" for k, v in given.items()) or "defaults"))
        for it in self.items:
            what = f"{it.dtype}{list(it.shape)}" if it.kind == "tensor" else it.kind
            lay = f" save={_short(it.save)} load={_short(it.load)}" if it.kind == "tensor" else ""
            lines.append(f"  {'.'.join(map(str, it.path))}: {what}{lay}{' changed' if it.changed else ''}")
        return "\n".join(lines)


def _short(layout: Layout) -> str:
    nc = ("~nc" if layout.noncontig else "") + ("~lazy" if layout.lazy else "")
    if layout.kind == "dtensor":
        return f"dtensor{list(layout.mesh)}{['R' if p == REPLICATE else f'S{p}' for p in layout.placements]}{nc}"
    if layout.kind == "chunk":
        return f"chunk(dim={layout.dim},ranks={list(layout.placements)}){nc}"
    if layout.kind == "enum":
        return f"enum{[(list(o), list(s), r) for o, s, r in layout.shards]}{nc}"
    return f"plain{nc}"


# -------------------------------------------------------------------------------------- JSON codec


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _layout(raw: dict[str, Any]) -> Layout:
    return Layout(**{k: _tuples(v) for k, v in raw.items()})


def encode_case(case: Case) -> str:
    raw = asdict(case)
    for key in ("options", "save_transfer", "load_transfer"):
        raw[key] = {k: encode_value(v) for k, v in raw[key].items()}
    text = json.dumps(raw, separators=(",", ":"), sort_keys=True)
    return base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()


def decode_case(blob: str) -> Case:
    raw = json.loads(zlib.decompress(base64.urlsafe_b64decode(blob.encode())))
    items = tuple(
        Item(
            **{
                **it,
                "path": tuple(it["path"]),
                "shape": tuple(it["shape"]),
                "save": _layout(it["save"]),
                "load": _layout(it["load"]),
            }
        )
        for it in raw["items"]
    )
    opts = {k: {n: decode_value(v) for n, v in raw[k].items()} for k in ("options", "save_transfer", "load_transfer")}
    return Case(raw["w1"], raw["w2"], raw["target"], items, **opts)


def partial(case: Case) -> Case:
    """What a partial load asks for (the partial_load option): the case without the items of its first
    top-level key, where it has two or more (the weights without the optimizer)."""
    keys = sorted({str(it.path[0]) for it in case.items})
    if len(keys) < 2:
        return case
    return replace(case, items=tuple(it for it in case.items if str(it.path[0]) != keys[0]))


# -------------------------------------------------------------------------------------- strategies

_seeds = st.integers(0, 2**31 - 1)
#: Whether an item changes between an incremental case's base and its save (a third do: most bytes stay).
_changed = st.sampled_from((False, False, True))


@st.composite
def shapes(draw: Any) -> tuple[int, ...]:
    size = draw(st.sampled_from(("small", "small", "small", "medium", "empty", "scalar", "big")))
    if size == "scalar":
        return ()
    if size == "empty":
        dims = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
        return tuple(dims) if 0 in dims else (0, *dims)
    if size == "big":  # 64K..160K elements (0.25..1.3 MiB): multipart uploads, several read chunks
        return (draw(st.integers(128, 320)), 512)
    ndim = draw(st.integers(1, 3))
    hi = 12 if size == "small" else (4000, 64, 24)[ndim - 1]  # medium: up to ~16K elements
    return tuple(draw(st.lists(st.integers(1, hi), min_size=ndim, max_size=ndim)))


@st.composite
def layouts(draw: Any, shape: tuple[int, ...], world: int) -> Layout:
    ndim, numel = len(shape), 1
    for n in shape:
        numel *= n
    kinds = ["plain", "dtensor"] + (["chunk", "enum"] if ndim and numel else [])
    kind = draw(st.sampled_from(kinds))
    noncontig = draw(st.booleans()) if numel > 1 else False
    lazy = kind in ("plain", "dtensor") and draw(st.integers(0, 3)) == 0
    if kind == "dtensor":
        mesh = draw(st.sampled_from(MESHES[world]))
        places = tuple(draw(st.sampled_from((REPLICATE, *range(ndim)))) for _ in mesh)
        return Layout("dtensor", mesh=mesh, placements=places, noncontig=noncontig, lazy=lazy)
    if kind == "chunk":
        dim = draw(st.integers(0, ndim - 1))
        count = draw(st.integers(1, min(2 * world, shape[dim] + 1)))
        ranks = tuple(draw(st.lists(st.integers(0, world - 1), min_size=count, max_size=count)))
        return Layout("chunk", placements=ranks, dim=dim)  # ShardedTensor requires contiguous local shards
    if kind == "enum":
        return Layout("enum", shards=draw(enum_shards(shape, world)))
    return Layout("plain", noncontig=noncontig, lazy=lazy)


@st.composite
def enum_shards(draw: Any, shape: tuple[int, ...], world: int) -> tuple[Any, ...]:
    """A grid of uneven blocks over one or two dims, each block on a drawn rank (several per rank)."""
    ndim = len(shape)
    split = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=min(2, ndim), unique=True))
    cuts: dict[int, list[int]] = {}
    for d in split:
        inner = draw(st.lists(st.integers(1, max(1, shape[d] - 1)), max_size=4, unique=True)) if shape[d] > 1 else []
        cuts[d] = [0, *sorted(inner), shape[d]]
    blocks: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((0,) * ndim, tuple(shape))]
    for d, edges in cuts.items():
        nxt = []
        for offs, sizes in blocks:
            for lo, hi in zip(edges, edges[1:], strict=False):
                nxt.append((offs[:d] + (lo,) + offs[d + 1 :], sizes[:d] + (hi - lo,) + sizes[d + 1 :]))
        blocks = nxt
    ranks = draw(st.lists(st.integers(0, world - 1), min_size=len(blocks), max_size=len(blocks)))
    return tuple((o, s, r) for (o, s), r in zip(blocks, ranks, strict=True))


@st.composite
def tensor_item(draw: Any, path: tuple[Any, ...], w1: int, w2: int, shape: tuple[int, ...] | None = None) -> Item:
    shape = draw(shapes()) if shape is None else shape
    return Item(
        path,
        "tensor",
        draw(_seeds),
        dtype=draw(st.sampled_from(DTYPES)),
        shape=shape,
        save=draw(layouts(shape, w1)),
        load=draw(layouts(shape, w2)),
        changed=draw(_changed),
    )


@st.composite
def leaf(draw: Any, path: tuple[Any, ...], w1: int, w2: int) -> Item:
    kind = draw(st.sampled_from(("tensor", "tensor", "tensor", "bytes", "object")))
    if kind == "tensor":
        return draw(tensor_item(path, w1, w2))
    return Item(path, kind, draw(_seeds), changed=draw(_changed))


@st.composite
def subtree(draw: Any, path: tuple[Any, ...], w1: int, w2: int) -> list[Item]:
    """One top-level entry: a leaf, a nested dict or list of leaves, or an optimizer-shaped state."""
    shape = draw(st.sampled_from(("leaf", "leaf", "dict", "list", "optim")))
    if shape == "leaf":
        return [draw(leaf(path, w1, w2))]
    if shape in ("dict", "list"):
        n = draw(st.integers(1, 3))
        keys = list(range(n)) if shape == "list" else [f"k{i}" for i in range(n)]
        out: list[Item] = []
        for key in keys:
            nested = draw(st.booleans()) and shape == "dict"
            out += draw(subtree((*path, key), w1, w2)) if nested else [draw(leaf((*path, key), w1, w2))]
        return out
    # torch.optim-like: {"state": {param: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{...}]}
    out = []
    params = [f"layer{i}.weight" for i in range(draw(st.integers(1, 2)))]
    for p in params:
        moment = draw(tensor_item((*path, "state", p, "exp_avg"), w1, w2))
        second = draw(tensor_item((*path, "state", p, "exp_avg_sq"), w1, w2, shape=moment.shape))
        step = Item((*path, "state", p, "step"), "tensor", draw(_seeds), dtype="float32", changed=moment.changed)
        out += [moment, second, step]
    out.append(Item((*path, "param_groups", 0, "lr"), "object", draw(_seeds)))
    out.append(Item((*path, "param_groups", 0, "params"), "object", draw(_seeds)))
    return out


def default_case(w1: int, w2: int, target: str, kind: str, items: tuple[Item, ...]) -> Case:
    """A case with every option at its first value (the product's defaults; a plain, not incremental save)."""
    first = {o.name: o.values[0] for o in OPTIONS if applicable(o, kind, target)}
    scopes = {o.name: o.scope for o in OPTIONS}
    options = {k: v for k, v in first.items() if scopes[k] != "transfer"}
    transfer = {k: v for k, v in first.items() if scopes[k] == "transfer"}
    return Case(w1, w2, target, items, options, transfer, dict(transfer))


def option_values(kind: str, target: str, scopes: tuple[str, ...]) -> Any:
    """A strategy for one drawn value of every option of ``scopes`` (that applies to ``kind`` and ``target``)."""
    chosen = [o for o in OPTIONS if o.scope in scopes and applicable(o, kind, target) and not o.derived]
    return st.fixed_dictionaries({o.name: st.sampled_from(o.values) for o in chosen})


def derived_values(kind: str, target: str, draws: Any) -> dict[str, Any]:
    """The values of the ``derived`` options that apply to ``kind`` and ``target``, each picked by a CRC32 of
    ``draws`` (the case's other draws) and its name, so that they take no draw of their own."""
    seed = repr(draws).encode()
    chosen = [o for o in OPTIONS if o.derived and applicable(o, kind, target)]
    return {o.name: o.values[zlib.crc32(o.name.encode(), zlib.crc32(seed)) % len(o.values)] for o in chosen}


@st.composite
def cases(draw: Any, targets: tuple[str, ...], kinds: dict[str, str]) -> Case:
    """A whole case; ``targets`` are the store names to draw from, ``kinds`` maps each to its kind."""
    w1 = draw(st.integers(1, 4))
    w2 = draw(st.integers(1, 4))
    target = draw(st.sampled_from(targets))
    items: list[Item] = []
    for i in range(draw(st.integers(1, 5))):
        items += draw(subtree((f"e{i}",), w1, w2))
    kind = kinds[target]
    scopes = ("writer", "reader", "staging", "s3", "gcs", "azure", "save", "load", "case")
    options = draw(option_values(kind, target, scopes))
    save_transfer = draw(option_values(kind, target, ("transfer",)))
    load_transfer = draw(option_values(kind, target, ("transfer",)))
    draws = (w1, w2, target, items, sorted(options.items()), sorted(save_transfer.items()))
    options.update(derived_values(kind, target, draws))
    return Case(w1, w2, target, tuple(items), options, save_transfer, load_transfer)
