"""The GCS wire contender of the peer races: the state dict's bytes as one blob through google-cloud-storage
with its defaults, the ceiling a checkpoint library's GCS I/O is measured against (run in bench_peers.py's
child processes for bench_peers_gcs.py)."""

from __future__ import annotations

from typing import Any

import _common as C


def _blob(spec: dict[str, Any]) -> Any:
    from google.cloud import storage

    bucket, _, prefix = spec["uri"].split("://", 1)[1].partition("/")
    return storage.Client().bucket(bucket).blob(f"{prefix}/wire.bin")


def blob_save(spec: dict[str, Any], sd: dict[str, Any]) -> dict[str, Any]:
    """The state dict's bytes as one blob, with google-cloud-storage's defaults (resumable, 100 MiB chunks)."""
    import bench_throughput as BT

    views = C.tensor_byte_views(sd)
    _blob(spec).upload_from_file(BT._ScatterReader(views), size=sum(len(v) for v in views))
    return {}


def blob_load(spec: dict[str, Any], dest: dict[str, Any]) -> dict[str, Any]:
    """The one blob downloaded with google-cloud-storage's defaults, written into the tensors as it comes."""
    import bench_throughput as BT

    views = C.tensor_byte_views(dest)
    sink = BT._ScatterWriter(views)
    _blob(spec).download_to_file(sink)
    if sink.written != sum(len(v) for v in views):
        raise OSError(f"the blob had {sink.written} bytes, not {sum(len(v) for v in views)}")
    return {}
