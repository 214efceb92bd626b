"""Build a case's state dicts on a rank (values from seeds, laid out as drawn) and compare loaded leaves.

Every rank derives the same global value of an item from its seed (random bit patterns: NaNs with
payloads, infinities, subnormals and negative zeros included), so nothing but the case travels.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from fuzz_cases import REPLICATE, Case, Item, Layout

#: Which value of an item: the case's final one, the base's (incremental cases), or filler that a load overwrites.
FINAL, BASE, FILLER = "final", "base", "filler"

_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _seed_for(item: Item, which: str) -> int:
    if which == FILLER:
        return (item.seed * 7 + 13) % 2**31
    if which == BASE and item.changed:
        return (item.seed ^ 0x5EED5) % 2**31
    return item.seed


def tensor_value(item: Item, which: str) -> torch.Tensor:
    """The global tensor of ``item``: random bits of its dtype (bool: 0 or 1)."""
    dtype = getattr(torch, item.dtype)
    gen = torch.Generator().manual_seed(_seed_for(item, which))
    if dtype == torch.bool:
        return torch.randint(0, 2, item.shape, generator=gen, dtype=torch.uint8).bool()
    width = torch.empty((), dtype=dtype).element_size()
    if dtype.is_complex:  # two float32 halves of random bits
        bits = torch.randint(-(2**31), 2**31, (*item.shape, 2), generator=gen, dtype=torch.int64)
        return bits.to(torch.int32).view(torch.float32).view(dtype).reshape(item.shape)
    lo, hi = (0, 256) if width == 1 else (-(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1)
    if width == 8:
        lo, hi = -(2**62), 2**62
    bits = torch.randint(lo, hi, item.shape, generator=gen, dtype=torch.int64).to(_WIDTH_INT[width])
    return bits.view(dtype)


def object_value(item: Item, which: str) -> Any:
    """A picklable Python value; its type follows from the seed too."""
    s = _seed_for(item, which)
    pick = s % 6
    if pick == 0:
        return s
    if pick == 1:
        return f"obj-{s}-ä"
    if pick == 2:
        return [s % 97, (s // 97) % 89, "x"]
    if pick == 3:
        return (s % 1000) / 7.0
    if pick == 4:
        return (s % 5, str(s))
    return None


def bytes_value(item: Item, which: str) -> bytes:
    s = _seed_for(item, which)
    gen = torch.Generator().manual_seed(s)
    return bytes(torch.randint(0, 256, (s % 300,), generator=gen, dtype=torch.uint8).tolist())


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values with non-contiguous strides (transposed storage, or every other element)."""
    if t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    wide = torch.empty((*t.shape[:-1], t.shape[-1] * 2) if t.dim() else (2,), dtype=t.dtype)
    view = wide[..., ::2] if t.dim() else wide[0]
    view.copy_(t)
    return view


def _lazy(t: torch.Tensor) -> torch.Tensor:
    """The same values held by a lazy view whose memory is not them: complex, the conjugate bit over the
    conjugated values; float32/64, the negative bit over the negated values; other dtypes as they are
    (torch negates a strided bfloat16 or float16 through float32, which turns a NaN's payload canonical:
    the values would not survive being held, in torch's hands or ours)."""
    if t.is_complex():
        return t.conj().resolve_conj().conj()
    if t.dtype in (torch.float32, torch.float64):
        return torch._neg_view(-t)
    return t


def _held(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    t = _noncontig(t) if layout.noncontig else t
    return _lazy(t) if layout.lazy else t


def _placements(layout: Layout) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == REPLICATE else Shard(p) for p in layout.placements]


def _slices(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


def _sharded(full: torch.Tensor, layout: Layout, group: Any) -> Any:
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    if layout.kind == "chunk":
        spec: Any = ChunkShardingSpec(dim=layout.dim, placements=[f"rank:{r}/cpu" for r in layout.placements])
    else:
        spec = EnumerableShardingSpec(
            [ShardMetadata(list(o), list(s), f"rank:{r}/cpu") for o, s, r in layout.shards]  # type: ignore[arg-type]
        )
    st = empty(spec, *full.shape, dtype=full.dtype, process_group=group)
    for shard in st.local_shards():
        md = shard.metadata
        shard.tensor.copy_(full[_slices(tuple(md.shard_offsets), tuple(md.shard_sizes))])
    return st


def place(full: torch.Tensor, layout: Layout, world: Any, size: int) -> Any:
    """``full`` held as ``layout`` says by this rank of the first ``size`` ranks of ``world`` (a fuzz_world.Ranks)."""
    if layout.kind == "plain":
        return _held(full.clone(), layout)
    if layout.kind == "dtensor":
        from torch.distributed.tensor import DTensor, distribute_tensor

        mesh = world.meshes[layout.mesh]
        dt = distribute_tensor(full.clone(), mesh, _placements(layout), src_data_rank=None)
        if not (layout.noncontig or layout.lazy) or dt.to_local().numel() < 2:
            return dt
        return DTensor.from_local(
            _held(dt.to_local().clone(), layout),
            mesh,
            _placements(layout),
            run_check=False,
            shape=full.shape,
            stride=full.contiguous().stride(),
        )
    return _sharded(full, layout, world.groups[size])


def build(case: Case, side: str, which: str, world: Any) -> dict[str, Any]:
    """The nested state dict of ``case`` as this rank holds it for the save (side "save") or load ("load")."""
    root: dict[str, Any] = {}
    size = case.w1 if side == "save" else case.w2
    for item in case.items:
        if item.kind == "tensor":
            value: Any = place(tensor_value(item, which), item.save if side == "save" else item.load, world, size)
        elif item.kind == "bytes":
            value = io.BytesIO(bytes_value(item, which))
        else:
            value = object_value(item, which)
        _set(root, item.path, value)
    return root


def _set(root: Any, path: tuple[Any, ...], value: Any) -> None:
    node = root
    for key, nxt in zip(path, path[1:], strict=False):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def get(root: Any, path: tuple[Any, ...]) -> Any:
    node = root
    for key in path:
        node = node[key]
    return node


# -------------------------------------------------------------------------------------- snapshots


def _bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor's elements in row-major order, whatever its strides."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def snapshot(value: Any) -> Any:
    """A comparable, picklable copy of one loaded leaf (this rank's part of it)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ("tensor", *_tensor_facts(value.to_local()))
    if isinstance(value, ShardedTensor):
        shards = sorted((tuple(s.metadata.shard_offsets), _tensor_facts(s.tensor)) for s in value.local_shards())
        return ("shards", tuple(shards))
    if isinstance(value, torch.Tensor):
        return ("tensor", *_tensor_facts(value))
    if isinstance(value, io.BytesIO):
        return ("bytes", value.getvalue())
    return ("object", type(value).__name__, repr(value))


def _tensor_facts(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return (str(t.dtype), tuple(t.shape), _bits(t))


def snapshot_state(case: Case, state: dict[str, Any], before: dict[tuple[Any, ...], int] | None) -> dict[str, Any]:
    """Every leaf of ``state``, and whether each tensor leaf is still the object the load was given."""
    out: dict[str, Any] = {}
    for item in case.items:
        value = get(state, item.path)
        snap = snapshot(value)
        if before is not None and item.kind == "tensor":
            snap = (*snap, "in place" if id(value) == before.get(item.path) else "replaced")
        out[".".join(map(str, item.path))] = snap
    return out


def identities(case: Case, state: dict[str, Any]) -> dict[tuple[Any, ...], int]:
    return {it.path: id(get(state, it.path)) for it in case.items if it.kind == "tensor"}


def differences(got: dict[str, Any], want: dict[str, Any], what: str) -> list[str]:
    """One line per leaf where ``got`` differs from ``want`` (dtype, shape, bits, type, value, in place)."""
    out = []
    for key, expected in want.items():
        actual = got.get(key)
        if actual != expected:
            out.append(f"{what}: {key}: {_explain(actual, expected)}")
    return out


def _explain(actual: Any, expected: Any) -> str:
    if actual is None or expected is None or actual[0] != expected[0]:
        return f"{_brief(actual)} != {_brief(expected)}"
    if actual[0] == "tensor":
        for name, a, e in zip(("dtype", "shape"), actual[1:3], expected[1:3], strict=True):
            if a != e:
                return f"{name} {a} != {e}"
        if actual[3] != expected[3]:
            first = next((i for i, (x, y) in enumerate(zip(actual[3], expected[3], strict=False)) if x != y), None)
            return f"bits differ (first differing byte {first} of {len(expected[3])})"
        return f"{actual[4:]} != {expected[4:]}"
    return f"{_brief(actual)} != {_brief(expected)}"


def _brief(snap: Any) -> str:
    if snap is None:
        return "missing"
    if snap[0] == "tensor":
        return f"tensor({snap[1]}, {list(snap[2])}{', ' + snap[4] if len(snap) > 4 else ''})"
    if snap[0] == "shards":
        return "shards(" + ", ".join(f"{list(o)}:{list(f[1])}" for o, f in snap[1]) + ")"
    text = repr(snap)
    return text if len(text) < 200 else text[:200] + "..."


def scribble(case: Case, state: dict[str, Any]) -> None:
    """Overwrite every tensor of ``state`` in place (training going on while an async save uploads)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    for item in case.items:
        if item.kind != "tensor":
            continue
        value = get(state, item.path)
        locals_ = (
            [value.to_local()]
            if isinstance(value, DTensor)
            else [s.tensor for s in value.local_shards()]
            if isinstance(value, ShardedTensor)
            else [value]
        )
        for t in locals_:
            t.fill_(True if t.dtype == torch.bool else 7)
