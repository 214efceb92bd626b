"""The contenders of the peer benchmark: how each one's writer and reader is built in a child process,
and how the peers are installed beside (never into) this environment.

Contenders:

* ``dcp_cloud``   ``S3Writer`` / ``S3Reader`` (block checksums on: the default);
* ``s3tc_t1``, ``s3tc_t4``  s3torchconnector 1.5.0's ``S3StorageWriter(thread_count=1 / 4)`` and its
  default ``S3StorageReader``, path-style, endpoint from ``AWS_ENDPOINT_URL``;
* ``fsspec_t4``   torch's stock ``FsspecWriter(thread_count=4)`` / ``FsspecReader`` over s3fs
  (``endpoint_url`` passed through to ``S3FileSystem``);
* ``stock_fs_t1`` torch's ``FileSystemWriter(thread_count=1)`` / ``FileSystemReader`` on local disk;
* ``wire``        the same bytes moved with boto3 in dcp_cloud's request shape (bench_throughput.py's
  wire baseline; one process only);
* ``dcp_cloud_ref`` the ``dcp_cloud`` contender run from another checkout (``--ref-path``).

On GCS (bench_peers_gcs.py; ``dcp_cloud`` is then ``GCSWriter`` / ``GCSReader``):

* ``gcsfs_t4``    torch's stock ``FsspecWriter(thread_count=4)`` / ``FsspecReader`` over gcsfs
  (``endpoint_url`` and ``token="anon"`` as storage options; ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``,
  without which gcsfs asks the gRPC Storage Control API for each bucket's layout, which the emulator
  does not serve: every lookup retries for 60 s);
* ``dataflux``    gcs-torch-dataflux 1.4.0's ``GCSDistributedReader`` (it finds the emulator through
  ``STORAGE_EMULATOR_HOST``); it loads what ``gcsfs_t4`` saved, stock DCP files, because its writer
  uploads with GCS's XML multipart API, which fake-gcs-server rejects (400);
* ``wire_gcs``    google-cloud-storage's one-blob upload and download of the same bytes, with the
  library's defaults (100 MiB resumable chunks up, one streamed GET down; one process only).

On Azure (bench_peers_azure.py; ``dcp_cloud`` is then ``AzureWriter`` / ``AzureReader``):

* ``adlfs_t4``    torch's stock ``FsspecWriter(thread_count=4)`` / ``FsspecReader`` over adlfs
  (``abfs://container/prefix``, the connection string as a storage option);
* ``msc_t4``      multi-storage-client's DCP integration (``MultiStorageFileSystemWriter`` /
  ``MultiStorageFileSystemReader``, ``thread_count=4``) over its Azure provider (azure-storage-blob), a
  profile of its JSON configuration (``MSC_CONFIG``) naming the container and the connection string.

s3torchconnector and s3fs each live in their own ``pip install --target``
directory under the cache (``$DCP_CLOUD_BENCH_CACHE`` or
``~/.cache/dcp-cloud-bench``), put first on ``sys.path`` in their own child
processes only: s3fs brings its own aiobotocore and botocore, pinned so pip
does not fall back to an ancient s3fs, and this environment's boto3 stays as
it is. gcsfs likewise (it brings its own google-cloud-storage 3 and gRPC); gcs-torch-dataflux
needs google-cloud-storage 2.19 (it uses a helper 3.x removed) and imports ``lightning``: they go
``--no-deps`` into their own directory with lightning's own imports, and take google-auth and the
rest from this environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

S3TC_VERSION = "1.5.0"
S3FS_VERSION = "2026.9.0"
#: aiobotocore 3.10 (what s3fs 2026.9.0 needs) accepts botocore 1.43.115..117 only.
S3FS_BOTOCORE = "1.43.117"
GCSFS_VERSION = "2026.10.1"
DATAFLUX_VERSION = "1.4.0"
ADLFS_VERSION = "2026.8.0"
MSC_VERSION = "1.3.1"
#: What gcs-torch-dataflux imports beyond this environment, installed --no-deps beside it.
DATAFLUX_PACKAGES = (
    f"gcs-torch-dataflux=={DATAFLUX_VERSION}", "google-cloud-storage==2.19.0", "absl-py==2.5.1",
    "lightning==2.6.6", "lightning-utilities==0.15.3", "torchmetrics==1.9.0", "tqdm==4.70.1", "pyyaml==6.0.4",
)  # fmt: skip

S3TC = ("s3tc_t1", "s3tc_t4")
FSSPEC = ("fsspec_t4",)
GCSFS = ("gcsfs_t4",)
DATAFLUX = ("dataflux",)
GCS_PEERS = (*GCSFS, *DATAFLUX)
ADLFS = ("adlfs_t4",)
MSC = ("msc_t4",)
AZURE_PEERS = (*ADLFS, *MSC)
PEERS = (*S3TC, *FSSPEC, *GCS_PEERS, *AZURE_PEERS)
CLOUD = ("dcp_cloud", "dcp_cloud_ref", "wire", "wire_gcs", *PEERS)
LOCAL_DISK = ("stock_fs_t1",)
ALL = ("dcp_cloud", *PEERS, "wire", "wire_gcs", *LOCAL_DISK, "dcp_cloud_ref")
#: Contenders that cannot save where the race runs: who saves the checkpoints they load (not recorded).
SAVED_BY = {"dataflux": "gcsfs_t4"}
LABELS = {
    "dcp_cloud": "dcp_cloud",
    "dcp_cloud_ref": "dcp_cloud (--ref-path)",
    "s3tc_t1": f"s3torchconnector {S3TC_VERSION} t=1",
    "s3tc_t4": f"s3torchconnector {S3TC_VERSION} t=4",
    "fsspec_t4": f"FsspecWriter+s3fs {S3FS_VERSION} t=4",
    "stock_fs_t1": "FileSystemWriter t=1 (local disk)",
    "wire": "wire (boto3, dcp_cloud's requests)",
    "gcsfs_t4": f"FsspecWriter+gcsfs {GCSFS_VERSION} t=4",
    "dataflux": f"gcs-torch-dataflux {DATAFLUX_VERSION} (loads gcsfs's saves)",
    "wire_gcs": "wire (google-cloud-storage, one blob)",
    "adlfs_t4": f"FsspecWriter+adlfs {ADLFS_VERSION} t=4",
    "msc_t4": f"multi-storage-client {MSC_VERSION} t=4",
}
#: The multi-storage-client profile the Azure race configures (bench_peers_azure.py writes MSC_CONFIG).
MSC_PROFILE = "bench"


def cache_dir() -> str:
    return os.environ.get("DCP_CLOUD_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dcp-cloud-bench")


def s3tc_target() -> str:
    return os.path.join(cache_dir(), "s3tc")


def s3fs_target() -> str:
    return os.path.join(cache_dir(), f"s3fs-{S3FS_VERSION}")


def gcsfs_target() -> str:
    return os.path.join(cache_dir(), f"gcsfs-{GCSFS_VERSION}")


def dataflux_target() -> str:
    return os.path.join(cache_dir(), f"dataflux-{DATAFLUX_VERSION}")


def adlfs_target() -> str:
    return os.path.join(cache_dir(), f"adlfs-{ADLFS_VERSION}")


def msc_target() -> str:
    return os.path.join(cache_dir(), f"msc-{MSC_VERSION}")


def _pip_target(target: str, marker: str, packages: list[str], *, no_deps: bool) -> None:
    if os.path.isdir(os.path.join(target, marker)):
        return
    print(f"installing {' '.join(packages)} into {target} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", target, *packages]
    if no_deps:
        cmd.insert(4, "--no-deps")
    subprocess.run(cmd, check=True)


def install(contenders: list[str]) -> dict[str, str]:
    """Install the peers among ``contenders`` if missing; their ``--target`` directories by contender."""
    out: dict[str, str] = {}
    if any(c in S3TC for c in contenders):
        _pip_target(
            s3tc_target(), "s3torchconnector",
            [f"s3torchconnector=={S3TC_VERSION}", f"s3torchconnectorclient=={S3TC_VERSION}", "tenacity"],
            no_deps=True,
        )  # fmt: skip
        out.update(dict.fromkeys(S3TC, s3tc_target()))
    if any(c in FSSPEC for c in contenders):
        _pip_target(s3fs_target(), "s3fs", [f"s3fs=={S3FS_VERSION}", f"botocore=={S3FS_BOTOCORE}"], no_deps=False)
        out.update(dict.fromkeys(FSSPEC, s3fs_target()))
    if any(c in (*GCSFS, *DATAFLUX) for c in contenders):  # dataflux loads what gcsfs saved
        _pip_target(gcsfs_target(), "gcsfs", [f"gcsfs=={GCSFS_VERSION}"], no_deps=False)
        out.update(dict.fromkeys(GCSFS, gcsfs_target()))
    if any(c in DATAFLUX for c in contenders):
        _pip_target(dataflux_target(), "dataflux_pytorch", list(DATAFLUX_PACKAGES), no_deps=True)
        out.update(dict.fromkeys(DATAFLUX, dataflux_target()))
    if any(c in ADLFS for c in contenders):
        _pip_target(adlfs_target(), "adlfs", [f"adlfs=={ADLFS_VERSION}"], no_deps=False)
        out.update(dict.fromkeys(ADLFS, adlfs_target()))
    if any(c in MSC for c in contenders):
        _pip_target(msc_target(), "multistorageclient", [f"multi-storage-client[azure-storage-blob]=={MSC_VERSION}"],
                    no_deps=False)  # fmt: skip
        out.update(dict.fromkeys(MSC, msc_target()))
    return out


# ----------------------------------------------------------------------------- child side


def preload(spec: dict[str, Any]) -> None:
    """Put the contender's own directory first on sys.path and import what it needs (before the RSS baseline)."""
    import torch.distributed.checkpoint  # noqa: F401

    c = spec["contender"]
    if spec.get("target"):
        sys.path.insert(0, spec["target"])
    if c in S3TC:
        import s3torchconnector.dcp  # noqa: F401
    elif c in FSSPEC:
        import s3fs  # noqa: F401
        import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401
    elif c in GCSFS:
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # read when gcsfs is imported
        import gcsfs  # noqa: F401
        import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401
    elif c in DATAFLUX:
        import dataflux_pytorch.lightning  # noqa: F401
    elif c in ADLFS:
        import adlfs  # noqa: F401
        import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401
    elif c in MSC:
        import multistorageclient.contrib.torch.filesystem  # noqa: F401
    elif spec.get("backend") == "azure":
        import dcp_cloud  # noqa: F401
        import dcp_cloud.store.azure  # noqa: F401 - its client is built on first use, as the peers' are
    elif spec.get("backend") == "gcs":
        import google.cloud.storage  # noqa: F401 - dcp_cloud builds its GCS client from it, on first use

        import dcp_cloud  # noqa: F401
        import dcp_cloud.store.gcs  # noqa: F401
    elif c != "stock_fs_t1":
        import boto3  # noqa: F401
        import botocore.config  # noqa: F401

        import dcp_cloud  # noqa: F401
        import dcp_cloud.store.s3  # noqa: F401 - its S3 client, as the peers' imports above load theirs


def _threads(contender: str) -> int:
    return int(contender.rsplit("_t", 1)[1])


def _transfer(spec: dict[str, Any], **overrides: Any) -> Any:
    from dcp_cloud import TransferConfig

    return TransferConfig(**spec.get("transfer", {}), **overrides)


def _s3tc_kwargs() -> dict[str, Any]:
    from s3torchconnector import S3ClientConfig

    # Path-style: the local server has no virtual-host DNS. The endpoint comes from AWS_ENDPOINT_URL.
    return {
        "region": os.environ.get("AWS_REGION", "us-east-1"),
        "s3client_config": S3ClientConfig(force_path_style=True),
    }


def _fsspec_kwargs() -> dict[str, Any]:
    return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}


def _gcsfs_kwargs() -> dict[str, Any]:
    return {"endpoint_url": os.environ["STORAGE_EMULATOR_HOST"], "token": "anon"}


def _classes(spec: dict[str, Any]) -> tuple[Any, Any]:
    import dcp_cloud

    backend = spec.get("backend")
    if backend == "gcs":
        return dcp_cloud.GCSWriter, dcp_cloud.GCSReader
    if backend == "azure":
        return dcp_cloud.AzureWriter, dcp_cloud.AzureReader
    return dcp_cloud.S3Writer, dcp_cloud.S3Reader


def _azure_uri(spec: dict[str, Any], contender: str) -> str:
    """The contender's URI of ``az://container/prefix``: abfs:// for adlfs, msc://profile/prefix for MSC
    (whose profile names the container)."""
    rest = spec["uri"].split("://", 1)[1]
    if contender in ADLFS:
        return f"abfs://{rest}"
    return f"msc://{MSC_PROFILE}/{rest.split('/', 1)[1]}"


def make_writer(spec: dict[str, Any]) -> Any:
    c = spec["contender"]
    if c in ("dcp_cloud", "dcp_cloud_ref"):
        return _classes(spec)[0](spec["uri"], transfer=_transfer(spec))
    if c in ADLFS:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        cs = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
        return FsspecWriter(_azure_uri(spec, c), thread_count=_threads(c), connection_string=cs)
    if c in MSC:
        from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemWriter

        return MultiStorageFileSystemWriter(_azure_uri(spec, c), thread_count=_threads(c))
    if c in S3TC:
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter(path=spec["uri"], thread_count=_threads(c), **_s3tc_kwargs())
    if c in FSSPEC:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(spec["uri"], thread_count=_threads(c), **_fsspec_kwargs())
    if c in GCSFS:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(spec["uri"], thread_count=_threads(c), **_gcsfs_kwargs())
    if c == "stock_fs_t1":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(spec["path"], thread_count=1)
    raise ValueError(f"no writer for contender {c!r}")


def make_reader(spec: dict[str, Any]) -> Any:
    c = spec["contender"]
    if c in ("dcp_cloud", "dcp_cloud_ref"):
        return _classes(spec)[1](spec["uri"], transfer=_transfer(spec))
    if c in ADLFS:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(_azure_uri(spec, c), connection_string=os.environ["AZURE_STORAGE_CONNECTION_STRING"])
    if c in MSC:
        from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

        return MultiStorageFileSystemReader(_azure_uri(spec, c), thread_count=_threads(c))
    if c in S3TC:
        from s3torchconnector.dcp import S3StorageReader

        return S3StorageReader(path=spec["uri"], **_s3tc_kwargs())
    if c in FSSPEC:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(spec["uri"], **_fsspec_kwargs())
    if c in GCSFS:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(spec["uri"], **_gcsfs_kwargs())
    if c in DATAFLUX:
        from dataflux_pytorch.lightning import GCSDistributedReader

        return GCSDistributedReader(spec["uri"], project_name=os.environ["GOOGLE_CLOUD_PROJECT"])
    if c == "stock_fs_t1":
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(spec["path"])
    raise ValueError(f"no reader for contender {c!r}")


def module_of(obj: Any) -> str:
    """Where the contender's class was imported from (shows which checkout or --target it ran)."""
    return getattr(sys.modules.get(type(obj).__module__), "__file__", None) or type(obj).__module__
