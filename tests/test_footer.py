"""The index footer: versions 1 (CRCs) and 2 (CRCs and content hashes) round-trip, damage is named, and a save
records every item's hash by default (``hashes=False``: none)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from dcp_cloud import CloudWriter, CorruptCheckpointError
from dcp_cloud.format.contenthash import digest
from dcp_cloud.format.footer import DIGEST_VERSION, VERSION, FooterEntry, decode, decode_digests, encode, item_extras
from dcp_cloud.format.layout import ItemExtras, footer_table, load_metadata
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.testing.backends import StoreBackend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

entries = st.lists(
    st.builds(
        lambda offset, raw, n, digest: FooterEntry(
            offset, ItemExtras(raw, n * 7, 4096 if n else 0, os.urandom(4 * n)), digest
        ),
        st.integers(0, 2**40),
        st.one_of(st.none(), st.integers(0, 4096)),
        st.integers(0, 9),
        st.one_of(st.none(), st.binary(min_size=16, max_size=16).filter(any)),
    ),
    max_size=20,
    unique_by=lambda e: e.offset,
)


@given(entries)
def test_footers_round_trip_with_and_without_digests(items: list[FooterEntry]) -> None:
    body = encode(items)
    version = int.from_bytes(body[8:10], "big")
    with_digests = any(e.digest is not None for e in items)
    assert version == (DIGEST_VERSION if with_digests else VERSION)
    assert decode(body, "x") == {e.offset: e.extras for e in items}
    assert decode_digests(body, "x") == {e.offset: e.digest for e in items if e.digest is not None}


def test_damaged_digests_are_named() -> None:
    body = bytearray(encode([FooterEntry(0, ItemExtras(64, 8, 4096, b"\0\0\0\1"), b"\x11" * 16)]))
    body[-5] ^= 1  # a byte of the digest section
    with pytest.raises(CorruptCheckpointError, match="of obj"):
        decode_digests(bytes(body), "of obj")
    with pytest.raises(ValueError, match="16 bytes"):
        encode([FooterEntry(0, ItemExtras(64, 8, 4096, b"\0\0\0\1"), b"short")])


@pytest.mark.parametrize("hashes", [None, False])
def test_a_save_records_every_items_hash_by_default(hashes: bool | None) -> None:
    store = MemoryStore()
    state = {
        "w": torch.randn(300, 70),
        "half": torch.randn(1000).to(torch.bfloat16),
        "strided": torch.randn(40, 50).T,
        "empty": torch.zeros(0),
        "meta": {"step": 3, "lr": [0.1]},
    }
    kw = {} if hashes is None else {"hashes": hashes}
    dcp.save(state, storage_writer=CloudWriter("memory://bkt/c", StoreBackend(store), **kw))
    metadata = load_metadata(store.get("c/.metadata"), "c/.metadata")
    table = footer_table(metadata)
    assert table is not None
    found = {}
    for path, (offset, length) in table.items():
        body = store.get(f"c/{path}")[offset : offset + length]
        assert int.from_bytes(body[8:10], "big") == (VERSION if hashes is False else DIGEST_VERSION)
        found.update({(path, k): v for k, v in decode_digests(body, path).items()})
    if hashes is False:
        assert found == {}
        return
    for index, info in metadata.storage_data.items():
        value = found[(info.relative_path, int(info.offset))]
        if index.fqn in state and isinstance(state[index.fqn], torch.Tensor):
            assert value == digest(state[index.fqn]), index.fqn
        extras = item_extras(store, "c", metadata, info)
        assert extras is not None
