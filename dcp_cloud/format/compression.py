"""Compressed items: zstd as torch's ``ZStandard`` stream extension writes and reads it.

Stock torch (``FileSystemWriter(path, _extensions=[ZStandard()])``) stores
each item as one zstd stream of what it would otherwise store (the
``torch.save`` output of a tensor, or the bytes of a bytes item) and lists
the transform on the item's ``_StorageInfo.transform_descriptors``
(``["stream.zstd/1"]``, outermost transform first). Its reader undoes the
listed transforms in that order before ``torch.load``.

dcp_cloud writes and reads exactly that, so compressed checkpoints move
between stock torch and dcp_cloud both ways:

* writing (``compression="zstd"`` on the writers): :class:`CompressingSink`
  sits between the serializer and the shard's object stream, compressing as
  bytes pass and hashing the *compressed* bytes, so checksums cover what is
  stored and ``verify`` needs no decompression;
* reading: :func:`check_descriptors` refuses transforms we do not know, and
  :func:`decode` undoes the ones we do on an item read whole.

Compressed items are read whole (a byte range of a zstd stream is not a
byte range of the tensor), so a resharding load of a compressed checkpoint
fetches every saved chunk it overlaps in full.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, CorruptCheckpointError
from .checksum import Hasher

#: ``compression=`` values the writers accept (None: store items as they are).
CODECS = ("zstd",)
#: torch's descriptor of its ZStandard extension (``ZStandard.get_descriptor()``).
ZSTD_DESCRIPTOR = "stream.zstd/1"
_ZSTD_NAME = "stream.zstd"
#: Compressed output is handed to the object stream in pieces of at least this size.
_FLUSH_AT = 1 << 20


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise ConfigError(
            "zstd compression needs the 'zstandard' package (a dependency of dcp_cloud): pip install zstandard"
        ) from exc
    return zstandard


def validate(compression: str | None, level: int) -> None:
    """Raise ConfigError unless ``compression`` is None or a codec we write, at a valid level."""
    if compression is None:
        return
    if compression not in CODECS:
        raise ConfigError(f"compression must be None or one of {list(CODECS)}, got {compression!r}")
    zstandard = _zstandard()
    if not -7 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ConfigError(
            f"compression_level must be in -7..{zstandard.MAX_COMPRESSION_LEVEL} for zstd, got {level} "
            "(3 is zstd's default; negative levels trade ratio for speed)"
        )


def descriptors(compression: str | None) -> list[str] | None:
    """The ``transform_descriptors`` of an item written with ``compression`` (None when uncompressed)."""
    return [ZSTD_DESCRIPTOR] if compression == "zstd" else None


class CompressingSink(io.RawIOBase):
    """A write-only stream compressing into ``sink`` (an ObjectWriter), hashing what it stores.

    ``torch.save`` writes into it; :meth:`finish` ends the zstd frame. The
    compressed bytes go to ``sink`` in pieces of about 1 MiB and are fed to
    ``hasher`` (block CRC32C of the stored bytes).
    """

    def __init__(self, sink: Any, hasher: Hasher | None, level: int) -> None:
        super().__init__()
        self._sink = sink
        self._hasher = hasher
        self._compressor = _zstandard().ZstdCompressor(level=level).compressobj()
        self._out = bytearray()
        #: Uncompressed bytes taken.
        self.raw_bytes = 0
        #: The first error the object stream raised (torch.save hides it behind its own).
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.raw_bytes += len(view)
        self._out += self._compressor.compress(view)
        if len(self._out) >= _FLUSH_AT:
            self._emit()
        return len(view)

    def _emit(self) -> None:
        out, self._out = self._out, bytearray()
        if not out:
            return
        if self._hasher is not None:
            self._hasher.update(memoryview(out))
        try:
            self._sink.write(out)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise

    def finish(self) -> None:
        """End the zstd frame and pass everything on."""
        self._out += self._compressor.flush()
        self._emit()


def check_descriptors(descs: Sequence[str] | None, what: str) -> None:
    """Raise CorruptCheckpointError for transforms dcp_cloud cannot undo (anything but zstd v1)."""
    for desc in descs or ():
        name, _, version = str(desc).partition("/")
        if name != _ZSTD_NAME or version.partition(".")[0] != "1":
            raise CorruptCheckpointError(
                f"{what} was written with stream transforms {list(descs or ())!r}; dcp_cloud reads only "
                f"{ZSTD_DESCRIPTOR!r} (torch's ZStandard extension). Load it with torch's FileSystemReader "
                "and the extension registry that wrote it"
            )


def decode(descs: Sequence[str] | None, data: bytes | bytearray | memoryview, what: str) -> bytes | bytearray:
    """Undo ``descs`` (outermost first, as torch lists them) on one item's stored bytes."""
    out: Any = data
    for desc in descs or ():
        check_descriptors([desc], what)
        try:
            reader = _zstandard().ZstdDecompressor().stream_reader(io.BytesIO(out))
            out = reader.read()
        except Exception as exc:  # zstd reports damage with its own error types
            raise CorruptCheckpointError(
                f"{what} is not a readable zstd stream ({type(exc).__name__}); the stored object is damaged"
            ) from exc
    return out


def write_item(sink: Any, data: Any, hasher: Hasher | None, level: int) -> None:
    """Write one item (a ``BytesIO`` or a tensor) zstd-compressed into ``sink``, as stock torch would."""
    from .serialize import save_tensor
    from .tensorbytes import host_tensor, plain_and_exact

    out = CompressingSink(sink, hasher, level)
    if isinstance(data, io.BytesIO):
        out.write(data.getbuffer())
    else:
        tensor = data if plain_and_exact(data) else host_tensor(data)[0]
        try:
            save_tensor(tensor, out)
        except BaseException:
            if out.error is not None:  # torch's zip writer hides the store's typed error
                raise out.error from None
            raise
    out.finish()
