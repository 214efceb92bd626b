"""PyTorch Lightning checkpoints on S3, GCS and Azure through dcp_cloud, by configuration.

* :class:`DcpCloudCheckpointIO`: Lightning's ``CheckpointIO`` for single-file checkpoints (any strategy
  that uses a ``CheckpointIO``: single device, DDP; also under ``AsyncCheckpointIO``). A save is
  ``torch.save`` to bytes, then one object through dcp_cloud's store (CRC32C sent with the upload, a
  multipart upload past one block, create-only unless ``overwrite``); a load is ``torch.load`` with
  ``weights_only=True`` (it never runs code from the checkpoint).
* :class:`DcpCloudModelParallelStrategy`: Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel)
  whose sharded saves and loads of ``s3://``, ``gs://`` and ``az://`` paths go through dcp_cloud's writer
  and reader (stock wraps the path in ``Path``, which makes ``s3://b/x`` a local directory). Local paths
  keep stock behaviour.

Both serve fsspec's ``s3``/``gs``/``az`` protocols with dcp_cloud's filesystems
(:mod:`~dcp_cloud.integrations.filesystem`), so ``ModelCheckpoint(dirpath="s3://...")``'s path
operations (exists, removing old checkpoints) work without s3fs, gcsfs or adlfs, with the same configs.

This module imports Lightning (the ``pytorch-lightning`` distribution: ``pytorch_lightning`` and
``lightning_fabric``); ``dcp_cloud`` itself never imports it.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning
import torch
import torch.distributed.checkpoint as dcp
from lightning_fabric.plugins import CheckpointIO

# Lightning's private helpers that its own ModelParallelStrategy uses; kept to these three names.
from lightning_fabric.strategies.model_parallel import _has_dtensor_modules, _load_checkpoint
from lightning_fabric.utilities.load import _METADATA_FILENAME
from pytorch_lightning.strategies import ModelParallelStrategy

from ..dcp.factory import reader_for, writer_for
from ..errors import ConfigError, PreconditionFailedError, UnsafeCheckpointError
from ..locations import StoreConfig, config_scheme, scheme_of
from . import filesystem

log = logging.getLogger(__name__)

#: The Lightning release this module is tested with (pyproject.toml's ``lightning`` extra pins it).
TESTED_LIGHTNING = "2.6.6"
#: Schemes whose paths go through dcp_cloud (plain paths and ``file://`` keep Lightning's own code).
CLOUD_SCHEMES: tuple[str, ...] = ("s3", "gs", "az")

_warned = False


def _check_version() -> None:
    """Warn once per process when the installed Lightning is not the one tested."""
    global _warned
    version = getattr(pytorch_lightning, "__version__", "unknown")
    if not _warned and version != TESTED_LIGHTNING:
        _warned = True
        warnings.warn(
            f"dcp_cloud.integrations.lightning is tested with pytorch-lightning {TESTED_LIGHTNING}, "
            f"this is {version}: its checkpoint seams may differ",
            RuntimeWarning,
            stacklevel=3,
        )


def _by_scheme(configs: tuple[StoreConfig, ...]) -> dict[str, StoreConfig]:
    out: dict[str, StoreConfig] = {}
    for config in configs:
        scheme = config_scheme(config)
        if scheme is None:
            raise ConfigError(f"takes S3Config, GCSConfig and AzureConfig, got {type(config).__name__}")
        if scheme in out:
            raise ConfigError(f"got two configs for {scheme}:// ({type(config).__name__}); pass one")
        out[scheme] = config
    return out


def cloud_scheme(path: Any) -> str | None:
    """The dcp_cloud scheme of ``path`` if it is a cloud URI (``s3://``, ``gs://``, ``az://``), else None."""
    if path is None:
        return None
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if "://" not in text:
        return None
    try:
        scheme = scheme_of(text)
    except Exception:  # noqa: BLE001 - not a URI dcp_cloud knows: Lightning's own code decides
        return None
    return scheme if scheme in CLOUD_SCHEMES else None


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


class DcpCloudCheckpointIO(CheckpointIO):
    """Single-file Lightning checkpoints on S3, GCS and Azure through dcp_cloud's stores.

    ``configs``: at most one :class:`~dcp_cloud.S3Config`, ``GCSConfig`` and ``AzureConfig`` (without one, a
    cloud's environment). ``overwrite``: replace an existing object (Lightning's ``last.ckpt`` and
    ``Trainer.save_checkpoint`` to the same path need it; the default); ``False`` makes every save
    create-only (a FileExistsError if the path exists). ``fallback``: the ``CheckpointIO`` of paths that
    are not cloud URIs (default Lightning's ``TorchCheckpointIO``). Constructing one serves fsspec's
    ``s3``/``gs``/``az`` protocols with dcp_cloud's filesystems and these configs."""

    def __init__(self, *configs: StoreConfig, overwrite: bool = True, fallback: CheckpointIO | None = None) -> None:
        _check_version()
        from lightning_fabric.plugins import TorchCheckpointIO

        self.configs = _by_scheme(configs)
        self.overwrite = bool(overwrite)
        self.fallback = fallback if fallback is not None else TorchCheckpointIO()
        filesystem.register(self.configs)

    def _fs(self, path: Any) -> filesystem.StoreFileSystem:
        scheme = cloud_scheme(path)
        assert scheme is not None
        cls = {"s3": filesystem.S3FileSystem, "gs": filesystem.GCSFileSystem, "az": filesystem.AzureFileSystem}
        return cls[scheme](config=self.configs.get(scheme), skip_instance_cache=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if cloud_scheme(path) is None:
            self.fallback.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options; configure it with its configs")
        self.put_bytes(_to_bytes(checkpoint), str(path), create_only=not self.overwrite)

    def put_bytes(self, data: bytes, uri: str, *, create_only: bool) -> None:
        """Write ``data`` as the one object ``uri`` (one PUT with its CRC32C, or a multipart upload)."""
        fs = self._fs(uri)
        try:
            with fs.open(uri, "xb" if create_only else "wb") as f:
                f.write(data)
        except PreconditionFailedError as exc:
            raise FileExistsError(f"{uri} exists and this CheckpointIO saves create-only (overwrite=False)") from exc
        log.debug("saved checkpoint %s (%d bytes)", uri, len(data))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if cloud_scheme(path) is None:
            return self.fallback.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if weights_only is False:
            raise UnsafeCheckpointError(
                f"{type(self).__name__} loads with weights_only=True only (a checkpoint must never run code); "
                "allow your own classes with torch.serialization.add_safe_globals"
            )
        fs = self._fs(path)
        if not fs.isfile(str(path)):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        data = fs.cat_file(str(path))
        location = map_location if map_location is not None else "cpu"
        return torch.load(io.BytesIO(data), map_location=location, weights_only=True)

    def remove_checkpoint(self, path: Any) -> None:
        if cloud_scheme(path) is None:
            self.fallback.remove_checkpoint(path)
            return
        fs = self._fs(path)
        if fs.exists(str(path)):
            fs.rm(str(path), recursive=True)
            log.debug("removed checkpoint %s", path)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class DcpCloudModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose checkpoints of ``s3://``, ``gs://`` and ``az://`` paths
    go through dcp_cloud: a sharded save (``save_distributed_checkpoint=True``, the default) is
    ``dcp.save`` with :func:`~dcp_cloud.writer_for`'s writer (CRC32C per block, create-only commit of
    ``.metadata``) plus Lightning's ``meta.pt`` from rank 0; a load reads it with
    :func:`~dcp_cloud.reader_for`'s reader (any world size). A full checkpoint
    (``save_distributed_checkpoint=False``) is one object through :class:`DcpCloudCheckpointIO`.

    ``configs`` as for :class:`DcpCloudCheckpointIO`; ``overwrite``: a sharded save over a committed
    checkpoint replaces it (default False: ``CheckpointExistsError``; ``ModelCheckpoint`` versions
    its file names on a collision, but ``save_last`` rewrites ``last.ckpt`` and needs True). The other
    keywords are ``ModelParallelStrategy``'s."""

    def __init__(self, *configs: StoreConfig, overwrite: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cloud_io = DcpCloudCheckpointIO(*configs, overwrite=overwrite)
        self.overwrite = bool(overwrite)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if cloud_scheme(filepath) is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        uri = str(self.broadcast(str(filepath)))  # rank 0's path on every rank, as stock does
        config = self.cloud_io.configs.get(cloud_scheme(uri) or "")
        if not self._save_distributed_checkpoint:
            if self.global_rank == 0:
                self.cloud_io.put_bytes(_to_bytes(checkpoint), uri, create_only=not self.overwrite)
            return
        converted: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
            converted[f"optimizer_{index}"] = state
        dcp.save(converted, storage_writer=writer_for(uri, config, overwrite=self.overwrite))
        # The shards' .metadata (create-only unless overwrite) has committed; the rest of Lightning's state
        # (loops, callbacks, hyper-parameters) goes next to it as stock's meta.pt.
        if self.global_rank == 0:
            self.cloud_io.put_bytes(_to_bytes(checkpoint), _join(uri, _METADATA_FILENAME), create_only=False)
        self.barrier("DcpCloudModelParallelStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if cloud_scheme(checkpoint_path) is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        uri = str(self.broadcast(str(checkpoint_path)))
        config = self.cloud_io.configs.get(cloud_scheme(uri) or "")
        assert self.lightning_module is not None and self.model is not None
        strict = self.lightning_module.strict_loading
        fs = self.cloud_io._fs(uri)
        if fs.isfile(uri):  # a full checkpoint: one object; Lightning's own loader reads a local copy
            state = {"state_dict": self.model, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
            with tempfile.TemporaryDirectory() as tmp:
                local = Path(tmp) / "checkpoint.ckpt"
                local.write_bytes(fs.cat_file(uri))
                return _load_checkpoint(
                    path=local, state=state, strict=strict, optimizer_states_from_list=True, weights_only=True
                )
        if not fs.isfile(_join(uri, ".metadata")):
            raise FileNotFoundError(f"no committed checkpoint at {uri} (no .metadata)")
        return self._load_sharded(uri, config, strict)

    def _load_sharded(self, uri: str, config: StoreConfig | None, strict: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        if not _has_dtensor_modules(module):
            raise ValueError(
                f"{type(self).__name__} loads sharded checkpoints into a model parallelized in configure_model"
            )
        module_state = {"state_dict": get_model_state_dict(module)}
        dcp.load(module_state, storage_reader=reader_for(uri, config))
        module.load_state_dict(module_state["state_dict"], strict=strict)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optim_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp.load(optim_state, storage_reader=reader_for(uri, config))
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
            )
        return self.cloud_io.load_checkpoint(_join(uri, _METADATA_FILENAME), map_location="cpu")


__all__ = ["CLOUD_SCHEMES", "TESTED_LIGHTNING", "DcpCloudCheckpointIO", "DcpCloudModelParallelStrategy", "cloud_scheme"]
