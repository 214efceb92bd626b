"""A reusable conformance suite for :class:`~dcp_cloud.store.protocol.ObjectStore` backends.

Subclass :class:`ObjectStoreConformance` in a test module and provide a
``store`` fixture yielding a store on an empty bucket::

    from dcp_cloud.testing.conformance import ObjectStoreConformance

    class TestMyStore(ObjectStoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            yield MyStore(...)

Three more fixtures may be overridden: ``part_size`` (a multipart part size the
store accepts; by default its ``limits.min_part_size``, raised to at least
4 KiB so parts hold real data), ``picklable`` (``False`` for stores whose
pickled copies cannot reach the same objects, such as an in-process store) and
``create_only_is_atomic`` (``False`` for a store that refuses a create-only
write over an existing object but checks and writes in two steps, so that
writers racing to create one object may all succeed: the race test then asks
only that one of them is stored, whole, and that a later create-only write is
refused).
"""

from __future__ import annotations

import pickle
import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c
import pytest

from ..errors import CorruptCheckpointError, ObjectNotFoundError, PreconditionFailedError
from ..store.protocol import ObjectInfo, ObjectStore, PartInfo, StoreCapabilities

_MIN_TEST_PART = 4096


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _keys(infos: Sequence[ObjectInfo]) -> list[str]:
    return [i.key for i in infos]


class ObjectStoreConformance:
    """What every ObjectStore must do. Needs a ``store`` fixture on an empty bucket."""

    @pytest.fixture
    def part_size(self, store: ObjectStore) -> int:
        """A part size valid for ``store`` (every part but the last is this big)."""
        return min(max(store.limits.min_part_size, _MIN_TEST_PART), store.limits.max_part_size)

    @pytest.fixture
    def picklable(self) -> bool:
        """Whether a pickled copy of ``store`` reaches the same objects."""
        return True

    @pytest.fixture
    def create_only_is_atomic(self) -> bool:
        """Whether ``store`` lets exactly one of several racing create-only writes of one key succeed."""
        return True

    # -- basics ------------------------------------------------------------------

    def test_satisfies_protocol(self, store: ObjectStore) -> None:
        assert isinstance(store, ObjectStore)
        assert isinstance(store.capabilities, StoreCapabilities)
        assert store.limits.min_part_size <= store.limits.max_part_size
        assert store.url("some/key").endswith("some/key")

    def test_check_bucket(self, store: ObjectStore) -> None:
        store.check_bucket()

    def test_put_get_round_trip(self, store: ObjectStore) -> None:
        data = _blob(10_000, 1)
        info = store.put("dir/obj.bin", data)
        assert (info.key, info.size) == ("dir/obj.bin", len(data))
        assert store.get("dir/obj.bin") == data
        head = store.head("dir/obj.bin")
        assert (head.key, head.size) == ("dir/obj.bin", len(data))

    def test_put_overwrites(self, store: ObjectStore) -> None:
        store.put("obj", b"first version")
        store.put("obj", b"second")
        assert store.get("obj") == b"second"
        assert store.head("obj").size == len(b"second")

    def test_put_empty_object(self, store: ObjectStore) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.head("empty").size == 0
        store.read_into("empty", 0, [memoryview(bytearray(0))])

    @pytest.mark.parametrize(
        "kind", ["bytes", "bytearray", "memoryview-slice", "memoryview-int32", "memoryview-strided"]
    )
    def test_put_buffer_types(self, store: ObjectStore, kind: str) -> None:
        raw = _blob(8192, 2)
        if kind == "bytes":
            data, expected = raw, raw
        elif kind == "bytearray":
            data, expected = bytearray(raw), raw
        elif kind == "memoryview-slice":
            data, expected = memoryview(raw)[100:5100], raw[100:5100]
        elif kind == "memoryview-int32":
            data, expected = memoryview(bytearray(raw)).cast("i"), raw
        else:
            data, expected = memoryview(raw)[::2], raw[::2]
        info = store.put("buf", data)
        assert info.size == len(expected)
        assert store.get("buf") == expected

    def test_put_with_crc32c(self, store: ObjectStore) -> None:
        data = _blob(5000, 3)
        store.put("crc", data, crc32c=crc32c.crc32c(data))
        assert store.get("crc") == data

    def test_put_create_only(self, store: ObjectStore) -> None:
        store.put("once", b"original", create_only=True)
        with pytest.raises(PreconditionFailedError) as info:
            store.put("once", b"intruder", create_only=True)
        assert isinstance(info.value, FileExistsError)
        assert store.get("once") == b"original"

    def test_concurrent_create_only_has_one_winner(self, store: ObjectStore, create_only_is_atomic: bool) -> None:
        barrier = threading.Barrier(4)
        outcomes: list[str] = []

        def attempt(i: int) -> None:
            barrier.wait()
            try:
                store.put("race", f"writer-{i}".encode(), create_only=True)
                outcomes.append(f"writer-{i}")
            except PreconditionFailedError:
                outcomes.append("lost")

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(attempt, range(4)))
        winners = [o for o in outcomes if o != "lost"]
        if create_only_is_atomic:
            assert len(winners) == 1, outcomes
        else:  # no promise between racers: at least one won, and the others were refused, not failed
            assert winners, outcomes
        assert store.get("race") in {w.encode() for w in winners}  # one winner's body, whole
        with pytest.raises(PreconditionFailedError):
            store.put("race", b"late", create_only=True)  # once the object is there, it is refused
        assert store.get("race") in {w.encode() for w in winners}

    def test_concurrent_puts_of_distinct_keys(self, store: ObjectStore) -> None:
        blobs = {f"many/{i:02d}": _blob(1000 + i, 100 + i) for i in range(16)}
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: store.put(*kv), blobs.items()))
        assert _keys(list(store.list("many/"))) == sorted(blobs)
        for key, data in blobs.items():
            assert store.get(key) == data

    # -- ranged reads ----------------------------------------------------------------

    def test_read_into_one_out(self, store: ObjectStore) -> None:
        data = _blob(20_000, 4)
        store.put("r", data)
        out = bytearray(777)
        store.read_into("r", 0, [memoryview(out)])
        assert out == data[:777]
        store.read_into("r", 12_345, [memoryview(out)])
        assert out == data[12_345 : 12_345 + 777]

    def test_read_into_to_the_last_byte(self, store: ObjectStore) -> None:
        data = _blob(4096, 5)
        store.put("r", data)
        out = bytearray(96)
        store.read_into("r", 4000, [memoryview(out)])
        assert out == data[4000:]

    def test_read_into_scatter(self, store: ObjectStore) -> None:
        data = _blob(50_000, 6)
        store.put("r", data)
        sizes = [1, 4096, 10, 0, 20_000, 3]
        bufs = [bytearray(n) for n in sizes]
        store.read_into("r", 321, [memoryview(b) for b in bufs])
        pos = 321
        for buf in bufs:
            assert buf == data[pos : pos + len(buf)]
            pos += len(buf)

    def test_read_into_slices_of_one_buffer(self, store: ObjectStore) -> None:
        data = _blob(9000, 7)
        store.put("r", data)
        target = bytearray(b"\xee" * 10_000)
        view = memoryview(target)
        store.read_into("r", 1000, [view[5000:6000], view[0:3000]])
        assert target[5000:6000] == data[1000:2000]
        assert target[0:3000] == data[2000:5000]
        assert target[3000:5000] == b"\xee" * 2000  # untouched
        assert target[6000:] == b"\xee" * 4000

    def test_read_into_zero_length(self, store: ObjectStore) -> None:
        store.put("r", b"abc")
        store.read_into("r", 1, [])
        store.read_into("r", 2, [memoryview(bytearray(0)), memoryview(bytearray(0))])

    @pytest.mark.parametrize("start", [4000, 4095, 4096, 10_000])
    def test_read_into_past_the_end(self, store: ObjectStore, start: int) -> None:
        store.put("r", _blob(4096, 9))
        with pytest.raises(CorruptCheckpointError):
            store.read_into("r", start, [memoryview(bytearray(200))])

    def test_read_into_missing(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError):
            store.read_into("missing", 0, [memoryview(bytearray(10))])

    # -- missing objects ---------------------------------------------------------------

    def test_get_and_head_missing(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError) as info:
            store.get("no/such/key")
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(ObjectNotFoundError) as info:
            store.head("no/such/key")
        assert isinstance(info.value, FileNotFoundError)

    # -- server-side copies -------------------------------------------------------------

    def test_copy_within_the_bucket(self, store: ObjectStore) -> None:
        data = _blob(300_000, 21)
        store.put("cp/src", data)
        store.put("cp/dst", b"old")
        info = store.copy("cp/src", "cp/dst")
        assert info.key == "cp/dst" and info.size == len(data)
        assert store.get("cp/dst") == data
        assert store.get("cp/src") == data
        assert store.head("cp/dst").size == len(data)

    def test_copy_empty_object(self, store: ObjectStore) -> None:
        store.put("cp/empty", b"")
        store.copy("cp/empty", "cp/empty-copy")
        assert store.get("cp/empty-copy") == b""

    def test_copy_missing_source(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError):
            store.copy("cp/no-such-source", "cp/dst")
        assert list(store.list("cp/dst")) == []

    # -- listing and deleting ----------------------------------------------------------

    def test_list_by_prefix_in_key_order(self, store: ObjectStore) -> None:
        """The keys under a prefix; in byte order only where ``capabilities.ordered_listing``."""
        keys = ["ckpt/a/bc/y", "ckpt/a/b/z", "ckpt/a/b-1", "ckpt/a/b/x", "ckpt/a0", "other/a/b/x"]
        for i, key in enumerate(keys):
            store.put(key, b"x" * (i + 1))

        def listed(prefix: str) -> list[ObjectInfo]:
            infos = list(store.list(prefix))
            return infos if store.capabilities.ordered_listing else sorted(infos, key=lambda i: i.key)

        assert _keys(listed("ckpt/a/b/")) == ["ckpt/a/b/x", "ckpt/a/b/z"]  # not the sibling "ckpt/a/bc"
        assert [i.size for i in listed("ckpt/a/b/")] == [4, 2]
        assert _keys(listed("ckpt/a/b")) == ["ckpt/a/b-1", "ckpt/a/b/x", "ckpt/a/b/z", "ckpt/a/bc/y"]
        assert _keys(listed("ckpt/")) == sorted(k for k in keys if k.startswith("ckpt/"))
        assert _keys(listed("")) == sorted(keys)
        assert list(store.list("nothing/")) == []

    def test_list_hides_uploads_in_progress(self, store: ObjectStore, part_size: int) -> None:
        store.put("u/done", b"x")
        upload_id = store.create_multipart("u/pending")
        store.put_part("u/pending", upload_id, 1, _blob(part_size, 10))
        assert _keys(list(store.list(""))) == ["u/done"]
        store.abort_multipart("u/pending", upload_id)

    def test_delete(self, store: ObjectStore) -> None:
        for key in ("d/1", "d/2", "d/3"):
            store.put(key, key.encode())
        store.delete(["d/1", "d/missing", "d/3"])
        assert _keys(list(store.list("d/"))) == ["d/2"]
        with pytest.raises(ObjectNotFoundError):
            store.get("d/1")
        store.delete([])
        store.delete(["d/1"])  # already gone: no error
        assert store.get("d/2") == b"d/2"

    # -- multipart -------------------------------------------------------------------------

    def test_multipart_out_of_order_from_threads(self, store: ObjectStore, part_size: int) -> None:
        chunks = [_blob(part_size, 11), _blob(part_size, 12), _blob(part_size // 2 + 7, 13)]
        upload_id = store.create_multipart("mp/obj")

        def upload(number: int) -> PartInfo:
            data = chunks[number - 1]
            return store.put_part("mp/obj", upload_id, number, data, crc32c=crc32c.crc32c(data))

        with ThreadPoolExecutor(3) as pool:
            parts = list(pool.map(upload, [3, 1, 2]))
        parts.sort(key=lambda p: p.number)
        assert [p.size for p in parts] == [len(c) for c in chunks]
        info = store.complete_multipart("mp/obj", upload_id, parts)
        whole = b"".join(chunks)
        assert (info.key, info.size) == ("mp/obj", len(whole))
        assert store.get("mp/obj") == whole
        assert store.head("mp/obj").size == len(whole)
        out = bytearray(100)
        store.read_into("mp/obj", part_size - 50, [memoryview(out)])  # across a part boundary
        assert out == whole[part_size - 50 : part_size + 50]
        assert [u.upload_id for u in store.list_multipart("mp/")] == []

    def test_multipart_parts_from_memoryviews(self, store: ObjectStore, part_size: int) -> None:
        whole = _blob(2 * part_size + 100, 14)
        view = memoryview(whole)
        upload_id = store.create_multipart("mp/views")
        parts = [
            store.put_part("mp/views", upload_id, 1, view[:part_size]),
            store.put_part("mp/views", upload_id, 2, view[part_size : 2 * part_size]),
            store.put_part("mp/views", upload_id, 3, view[2 * part_size :]),
        ]
        store.complete_multipart("mp/views", upload_id, parts)
        assert store.get("mp/views") == whole

    def test_multipart_create_only_over_existing(self, store: ObjectStore, part_size: int) -> None:
        store.put("mp/taken", b"the original")
        upload_id = store.create_multipart("mp/taken")
        parts = [store.put_part("mp/taken", upload_id, 1, _blob(part_size, 15))]
        with pytest.raises(PreconditionFailedError):
            store.complete_multipart("mp/taken", upload_id, parts, create_only=True)
        assert store.get("mp/taken") == b"the original"
        store.abort_multipart("mp/taken", upload_id)
        assert store.list_multipart("mp/") == []

    def test_multipart_create_only_new_key(self, store: ObjectStore, part_size: int) -> None:
        data = _blob(part_size + 10, 16)
        upload_id = store.create_multipart("mp/new")
        parts = [
            store.put_part("mp/new", upload_id, 1, data[:part_size]),
            store.put_part("mp/new", upload_id, 2, data[part_size:]),
        ]
        store.complete_multipart("mp/new", upload_id, parts, create_only=True)
        assert store.get("mp/new") == data

    def test_abort_multipart(self, store: ObjectStore, part_size: int) -> None:
        upload_id = store.create_multipart("mp/aborted")
        store.put_part("mp/aborted", upload_id, 1, _blob(part_size, 17))
        store.abort_multipart("mp/aborted", upload_id)
        assert upload_id not in [u.upload_id for u in store.list_multipart("")]
        with pytest.raises(ObjectNotFoundError):
            store.head("mp/aborted")
        assert list(store.list("mp/")) == []
        store.abort_multipart("mp/aborted", upload_id)  # twice: ignored

    def test_list_multipart(self, store: ObjectStore) -> None:
        first = store.create_multipart("lm/a/one")
        second = store.create_multipart("lm/b/two")
        pending = store.list_multipart("lm/a/")
        assert [(u.key, u.upload_id) for u in pending] == [("lm/a/one", first)]
        assert {u.upload_id for u in store.list_multipart("lm/")} == {first, second}
        assert store.list_multipart("zzz/") == []
        store.abort_multipart("lm/a/one", first)
        store.abort_multipart("lm/b/two", second)
        assert store.list_multipart("lm/") == []

    def test_part_reupload_replaces(self, store: ObjectStore, part_size: int) -> None:
        upload_id = store.create_multipart("mp/redo")
        store.put_part("mp/redo", upload_id, 1, _blob(part_size, 18))
        replacement = _blob(part_size, 19)
        part1 = store.put_part("mp/redo", upload_id, 1, replacement)
        tail = store.put_part("mp/redo", upload_id, 2, b"tail")
        store.complete_multipart("mp/redo", upload_id, [part1, tail])
        assert store.get("mp/redo") == replacement + b"tail"

    # -- size, pickling ------------------------------------------------------------------------

    def test_large_object_byte_exact(self, store: ObjectStore) -> None:
        data = _blob(3 * 1024 * 1024 + 123, 20)
        store.put("big", data, crc32c=crc32c.crc32c(data))
        assert store.head("big").size == len(data)
        assert store.get("big") == data
        out = bytearray(2 * 1024 * 1024)
        store.read_into("big", 777_777, [memoryview(out)[: 1024 * 1024], memoryview(out)[1024 * 1024 :]])
        assert out == data[777_777 : 777_777 + len(out)]

    def test_pickled_copy_works(self, store: ObjectStore, picklable: bool) -> None:
        if not picklable:
            pytest.skip("this store's pickled copies do not share its objects")
        store.put("p/before", b"written by the original")  # the original has a live client now
        copy = pickle.loads(pickle.dumps(store))
        assert copy.bucket == store.bucket
        assert copy.get("p/before") == b"written by the original"
        copy.put("p/after", b"written by the copy")
        assert store.get("p/after") == b"written by the copy"

    def test_close_then_reuse(self, store: ObjectStore) -> None:
        store.put("c", b"1")
        store.close()
        assert store.get("c") == b"1"
        store.put("c", b"2")
        assert store.get("c") == b"2"


__all__ = ["ObjectStoreConformance"]
