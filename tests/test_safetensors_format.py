"""The safetensors format and the export's planning, as pure functions: property tests, the reference
library as the oracle for headers, and every malformed header refused with a typed error."""

from __future__ import annotations

import json
import math
import struct

import pytest
import safetensors.torch as safetensors_torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.errors import ConfigError, CorruptCheckpointError, UnsupportedCheckpointError
from dcp_cloud.safetensors.format import (
    DTYPES,
    HEADER_LIMIT,
    build_header,
    build_index,
    file_order,
    header_length,
    parse_header,
    parse_index,
)
from dcp_cloud.safetensors.plan import assign_files, flat_boxes, plan_stripes, select_tensors

_SIMPLE = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
tensors = st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12).filter(
        lambda s: s != "__metadata__"
    ),
    st.tuples(st.sampled_from(_SIMPLE), shapes),
    max_size=6,
)


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@settings(max_examples=80, deadline=None)
@given(tensors, st.sampled_from([None, {"format": "pt"}]))
def test_header_is_the_reference_writers(spec: dict, metadata: dict | None) -> None:
    """Tensors in file order with our header are byte for byte what safetensors.torch.save writes (one
    metadata key at most: the reference orders a map of several by hash), and our parser reads its files."""
    values = {name: _values(DTYPES[dt], shape, i) for i, (name, (dt, shape)) in enumerate(spec.items())}
    order = file_order((name, t.dtype) for name, t in values.items())
    header, offsets = build_header([(n, values[n].dtype, tuple(values[n].shape)) for n in order], metadata)
    ours = header + b"".join(bytes(values[n].contiguous().reshape(-1).view(torch.uint8).numpy()) for n in order)
    reference = safetensors_torch.save(values, metadata=metadata)
    if [values[n].dtype.itemsize for n in order] == sorted((t.dtype.itemsize for t in values.values()), reverse=True):
        # The reference sorts by its dtype enum, not by element size: equal only where the two orders agree.
        ref_order = [e.name for e in _parse(reference).tensors]
        if ref_order == order:
            assert ours == reference
    parsed = _parse(reference)
    assert {e.name for e in parsed.tensors} == set(values)
    assert parsed.metadata == (metadata or {})
    for entry in _parse(ours).tensors:
        assert entry.shape == tuple(values[entry.name].shape)
        assert DTYPES[entry.dtype] == values[entry.name].dtype
    assert [o for o in offsets] == [(e.begin, e.end) for e in _parse(ours).tensors]
    assert len(header) % 8 == 0


def _parse(blob: bytes):
    n = header_length(blob[:8], len(blob), "mem://x")
    return parse_header(blob[8 : 8 + n], len(blob), "mem://x")


def _file(entries: dict, data: int, metadata: dict | None = None, pad: bool = True) -> bytes:
    body = dict(entries)
    if metadata is not None:
        body["__metadata__"] = metadata
    text = json.dumps(body).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"\0" * data


@pytest.mark.parametrize(
    ("blob", "message", "error"),
    [
        (b"\x10\0\0", "fewer than the 8", CorruptCheckpointError),
        (struct.pack("<Q", HEADER_LIMIT + 1) + b"{}", "over safetensors' limit", CorruptCheckpointError),
        (struct.pack("<Q", 64) + b"{}", "file is truncated", CorruptCheckpointError),
        (struct.pack("<Q", 4) + b"{\xff\xfe}", "not valid UTF-8 JSON", CorruptCheckpointError),
        (struct.pack("<Q", 3) + b"[1]", "not an object", CorruptCheckpointError),
        (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4), "truncated", CorruptCheckpointError),
        (
            _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 12),
            "does not cover the file",
            CorruptCheckpointError,
        ),
        (
            _file(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                12,
            ),
            "overlaps",
            CorruptCheckpointError,
        ),
        (
            _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),
            "leaves a hole of 4 bytes",
            CorruptCheckpointError,
        ),
        (
            _file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8),
            "needs 12 bytes",
            CorruptCheckpointError,
        ),
        (_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, 0), "shape", CorruptCheckpointError),
        (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, 4), "data_offsets", CorruptCheckpointError),
        (
            _file({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, 1),
            "does not read",
            UnsupportedCheckpointError,
        ),
        (_file({"a": [1]}, 0), "no dtype/shape", CorruptCheckpointError),
        (_file({}, 0, metadata={"k": 1}), "strings to strings", CorruptCheckpointError),
    ],
)
def test_bad_headers_are_refused(blob: bytes, message: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=message):
        _parse(blob)
    if error is CorruptCheckpointError and len(blob) >= 8:
        # The reference reader refuses them too (the oracle agrees on what is malformed).
        with pytest.raises(Exception):  # noqa: B017 - its error types are its own
            safetensors_torch.load(blob)


def test_a_header_over_the_limit_is_not_written() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="over safetensors' limit"):
        build_header([("a", torch.float32, (1,))], {"note": "x" * HEADER_LIMIT})


def test_dtypes_safetensors_cannot_hold_are_refused_with_a_way_out() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="cast it .dtype=. or leave it out"):
        build_header([("z", torch.complex128, (2,))])
    with pytest.raises(UnsupportedCheckpointError, match="complex128"):
        select_tensors({"z": ((2,), torch.complex128)})
    # A cast to a dtype safetensors holds is a way out (complex is not floating point: not cast).
    assert select_tensors({"w": ((2,), torch.float64)}, dtype=torch.bfloat16)[0].dtype == torch.bfloat16
    assert select_tensors({"i": ((2,), torch.int64)}, dtype=torch.bfloat16)[0].dtype == torch.int64


def test_select_prefix_rename_and_collisions() -> None:
    items = {"model.a": ((2,), torch.float32), "model.b": ((3,), torch.float32), "optim.a": ((2,), torch.float32)}
    out = select_tensors(items, prefix="model.")
    assert [(t.source, t.name) for t in out] == [("model.a", "a"), ("model.b", "b")]
    out = select_tensors(items, prefix="model.", rename=lambda n: None if n == "b" else f"x.{n}")
    assert [(t.source, t.name) for t in out] == [("model.a", "x.a")]
    with pytest.raises(ConfigError, match="would both be written as 'same'"):
        select_tensors(items, rename=lambda n: "same")
    with pytest.raises(ConfigError, match="does not allow"):
        select_tensors(items, rename=lambda n: "__metadata__")


@settings(max_examples=200, deadline=None)
@given(shapes, st.data())
def test_flat_boxes_tile_a_range_in_order(shape: tuple[int, ...], data: st.DataObject) -> None:
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    flat = torch.arange(numel).reshape(shape)
    boxes = list(flat_boxes(shape, start, end))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    got = []
    for offsets, lengths in boxes:
        view = flat
        for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
            view = view.narrow(dim, o, n)
        values = view.reshape(-1).tolist()
        assert values == list(range(values[0], values[0] + len(values))) if values else True  # contiguous
        got.extend(values)
    assert got == list(range(start, end))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(shapes, st.sampled_from([1, 2, 4, 8])), max_size=5).map(
        lambda ts: sorted(ts, key=lambda t: -t[1])
    ),
    st.integers(1, 200),
)
def test_stripes_cover_every_byte_once_within_the_budget(spec: list, budget: int) -> None:
    stripes = plan_stripes(spec, budget)
    stream = []
    for stripe in stripes:
        assert stripe.nbytes <= max(budget, max(item for _, item in spec))
        pos = 0
        for box in stripe.boxes:
            shape, item = spec[box.tensor]
            assert box.at == pos and box.at % item == 0  # in order, aligned to its elements
            strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
            flat = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(0)
            view = flat
            for dim, (o, n) in enumerate(zip(box.offsets, box.lengths, strict=True)):
                view = view.narrow(dim, o, n)
            stream.extend((box.tensor, v) for v in view.reshape(-1).tolist())
            pos += math.prod(box.lengths) * item
            del strides
        assert pos == stripe.nbytes
    assert stream == [(i, v) for i, (shape, _) in enumerate(spec) for v in range(math.prod(shape))]


def test_files_are_cut_at_the_maximum_size_in_checkpoint_order() -> None:
    out = select_tensors(
        {
            "a": ((10,), torch.float32),  # 40 bytes
            "b": ((10,), torch.int8),  # 10
            "c": ((30,), torch.float32),  # 120: larger than the limit, a file of its own
            "d": ((5,), torch.float64),  # 40
        }
    )
    files = assign_files(out, 60)
    assert [[t.name for t in f] for f in files] == [["a", "b"], ["c"], ["d"]]
    files = assign_files(out, 1000)
    assert [[t.name for t in f] for f in files] == [["d", "a", "c", "b"]]  # larger elements first, then by name


def test_index_round_trip_and_bad_indexes() -> None:
    body = build_index({"a": "model-00001-of-00002.safetensors"}, 40)
    assert json.loads(body)["metadata"]["total_size"] == 40
    assert parse_index(body, "x") == {"a": "model-00001-of-00002.safetensors"}
    for bad, message in [
        (b"{not json", "not valid JSON"),
        (b'{"metadata": {}}', "no weight_map"),
        (b'{"weight_map": {"a": "../x.safetensors"}}', "not a .safetensors file in the same directory"),
        (b'{"weight_map": {"a": "x.bin"}}', "not a .safetensors file"),
    ]:
        with pytest.raises(CorruptCheckpointError, match=message):
            parse_index(bad, "x")
