"""PyTorch Lightning checkpoints on object stores through dcp_cloud (:mod:`dcp_cloud.integrations.lightning`): a
real ``Trainer`` on CPU, ``ModelCheckpoint(dirpath="s3://...")`` and ``Trainer(ckpt_path="s3://...")``, single
files on moto, fake-gcs-server and Azurite, sharded checkpoints on moto.

A resumed run must reproduce the losses of an uninterrupted one (Adam: the optimizer state must come back).
What was saved is told to be dcp_cloud's, not fsspec's or stock torch's: single files carry the CRC32C
dcp_cloud's store sends with every upload; sharded checkpoints carry dcp_cloud's extras on the
metadata's ``StorageMeta`` (``META_ATTR``), and still load with torch's stock ``FileSystemReader``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import boto3
import pytest
import pytorch_lightning as pl  # CI installs the lightning extra: no skip when it is missing
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from dcp_cloud.format.layout import META_ATTR, load_metadata
from dcp_cloud.integrations import filesystem
from dcp_cloud.integrations.lightning import (
    DcpCloudCheckpointIO,
    DcpCloudModelParallelStrategy,
    cloud_scheme,
)
from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

EPOCHS = 4
HALF = 2


class Tiny(pl.LightningModule):
    """A linear regression whose losses depend on every step before (Adam's moments included)."""

    def __init__(self, parallel: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.parallel = parallel
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.parallel:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _trainer(epochs: int, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),  # no default ModelCheckpoint writing into the working directory
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **kwargs,
    )


def _keys(bucket: str, prefix: str) -> list[str]:
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def test_cloud_scheme_tells_cloud_uris_from_paths() -> None:
    assert [cloud_scheme(p) for p in ("s3://b/x.ckpt", "gs://b/x", "az://c/x")] == ["s3", "gs", "az"]
    assert [cloud_scheme(p) for p in ("/tmp/x.ckpt", Path("x"), "file:///tmp/x", None)] == [None] * 4


# AsyncCheckpointIO only moves the plugin's calls to a thread of its own, the same on every cloud: run on s3.
@pytest.mark.parametrize(
    ("backend", "asynchronous"),
    [("s3", False), ("s3", True), ("gcs", False), ("azure", False)],
    ids=["s3-sync", "s3-async", "gcs-sync", "azure-sync"],
    indirect=["backend"],
)
def test_single_file_checkpoints_resume(backend: Any, asynchronous: bool) -> None:
    import fsspec
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    try:
        whole = Tiny()
        _trainer(EPOCHS, []).fit(whole)

        def io_plugin() -> Any:
            ours = DcpCloudCheckpointIO()
            return AsyncCheckpointIO(ours) if asynchronous else ours

        run = backend.uri("run")
        first = Tiny()
        plugin = io_plugin()  # before ModelCheckpoint: it serves the fsspec protocol that ModelCheckpoint looks up
        served = type(fsspec.filesystem(backend.scheme, skip_instance_cache=True))
        assert served.__module__ == filesystem.__name__, f"{backend.scheme}:// served by {served}, not dcp_cloud"
        keep = ModelCheckpoint(dirpath=run, save_top_k=1, monitor="step", mode="max", every_n_epochs=1)
        _trainer(HALF, [keep], plugins=[plugin]).fit(first)
        # save_top_k=1: the earlier epoch's checkpoint was removed through the plugin, the last one kept.
        name = f"epoch={HALF - 1}-step={HALF * 4}.ckpt"
        assert backend.keys(run) == [name]
        if backend.name == "s3":
            head = boto3.client("s3").head_object(Bucket=backend.bucket, Key=f"run/{name}", ChecksumMode="ENABLED")
            assert "ChecksumCRC32C" in head, "not uploaded through dcp_cloud's store (no CRC32C)"
        stock = torch.load(io.BytesIO(backend.get(run, name)), weights_only=True)  # a plain Lightning checkpoint
        assert stock["global_step"] == HALF * 4 and "optimizer_states" in stock

        resumed = Tiny()
        plugin = io_plugin()
        again = ModelCheckpoint(dirpath=run, save_top_k=1, monitor="step", mode="max", every_n_epochs=1)
        _trainer(EPOCHS, [again], plugins=[plugin]).fit(resumed, ckpt_path=f"{run}/{name}")
        assert resumed.losses == whole.losses[HALF * 4 :]
        assert len(resumed.losses) == (EPOCHS - HALF) * 4
    finally:
        filesystem.unregister()


def test_checkpoint_io_is_create_only_without_overwrite_and_never_runs_code(s3_bucket: str) -> None:
    try:
        uri = f"s3://{s3_bucket}/one/x.ckpt"
        strict = DcpCloudCheckpointIO(overwrite=False)
        strict.save_checkpoint({"w": torch.ones(2)}, uri)
        with pytest.raises(FileExistsError):
            strict.save_checkpoint({"w": torch.zeros(2)}, uri)
        assert torch.equal(strict.load_checkpoint(uri)["w"], torch.ones(2))
        DcpCloudCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, uri)  # overwrite=True (default) replaces
        assert torch.equal(strict.load_checkpoint(uri)["w"], torch.zeros(2))
        evil = f"s3://{s3_bucket}/one/evil.ckpt"
        DcpCloudCheckpointIO().save_checkpoint({"f": _Callable()}, evil)
        with pytest.raises(Exception, match="weights_only|Unsupported global|WeightsUnpickler"):
            strict.load_checkpoint(evil)
        with pytest.raises(ValueError, match="weights_only=True"):
            strict.load_checkpoint(evil, weights_only=False)
        strict.remove_checkpoint(uri)
        with pytest.raises(FileNotFoundError):
            strict.load_checkpoint(uri)
    finally:
        filesystem.unregister()


class _Callable:
    """An object whose unpickling would need its class: weights_only refuses it."""


def _train_on_ranks(rank: int, world: int, bucket: str) -> dict[str, Any]:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    warnings.filterwarnings("ignore")

    def trainer(epochs: int, dirpath: str | None = None) -> pl.Trainer:
        os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": "0"})
        # The strategy first: it serves fsspec's s3:// that ModelCheckpoint looks its dirpath up with.
        strategy = DcpCloudModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        callbacks = [ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_epochs=1)] if dirpath else []
        return _trainer(epochs, callbacks, devices=world, strategy=strategy)

    try:
        whole = Tiny(parallel=True)
        trainer(EPOCHS).fit(whole)
        first = Tiny(parallel=True)
        first_trainer = trainer(HALF, f"s3://{bucket}/sharded")
        first_trainer.fit(first)
        ckpt = f"s3://{bucket}/sharded/epoch={HALF - 1}-step={HALF * 2}.ckpt"
        try:  # overwrite=False: the .metadata commit is create-only
            first_trainer.save_checkpoint(ckpt)
            again = "saved over"
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            again = f"{type(exc).__name__}: {exc}"
        full = get_model_state_dict(first.net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        resumed = Tiny(parallel=True)
        trainer(EPOCHS).fit(resumed, ckpt_path=ckpt)
        dist.barrier()
    finally:
        filesystem.unregister()  # a reused world's next call must not find fsspec's s3 served
    return {
        "again": again,
        "whole": whole.losses,
        "resumed": resumed.losses,
        "full": {k: v.tolist() for k, v in full.items()},
    }


def test_sharded_checkpoints_on_two_gloo_ranks_resume_on_s3(
    s3_bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_ranks(2, _train_on_ranks, s3_bucket, env=s3_env, timeout=240)
    steps_per_epoch = 2  # 4 batches of 8, over 2 data-parallel ranks
    for rank in out:
        assert "CheckpointExistsError" in rank["again"], rank["again"]
        assert rank["resumed"] == rank["whole"][HALF * steps_per_epoch :], "resume differs from the whole run"
        assert len(rank["resumed"]) == (EPOCHS - HALF) * steps_per_epoch
    prefix = f"sharded/epoch={HALF - 1}-step={HALF * steps_per_epoch}.ckpt/"
    keys = _keys(s3_bucket, prefix)
    assert prefix + ".metadata" in keys and prefix + "meta.pt" in keys
    assert sum(k.endswith(".distcp") for k in keys) >= 2, keys
    s3 = boto3.client("s3")
    metadata = s3.get_object(Bucket=s3_bucket, Key=prefix + ".metadata")["Body"].read()
    assert getattr(load_metadata(metadata, "x").storage_meta, META_ATTR, None) is not None, "not dcp_cloud's save"
    local = tmp_path / "ckpt"
    local.mkdir()
    for key in keys:
        (local / key[len(prefix) :]).write_bytes(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    dcp_to_torch_save(local, tmp_path / "full.pt")  # torch's stock FileSystemReader
    stock = torch.load(tmp_path / "full.pt", weights_only=True)
    for name, value in out[0]["full"].items():
        assert stock["state_dict"][f"net.{name}"].tolist() == value
    assert set(stock) >= {"state_dict", "optimizer_0"}


def test_dcp_cloud_imports_without_lightning() -> None:
    code = (
        "import sys\n"
        "for name in ('pytorch_lightning', 'lightning_fabric', 'lightning'): sys.modules[name] = None\n"
        "import dcp_cloud, dcp_cloud.integrations.routing, dcp_cloud.integrations.filesystem\n"
        "dcp_cloud.install(); dcp_cloud.uninstall()\n"
        "try:\n"
        "    import dcp_cloud.integrations.lightning\n"
        "except ImportError:\n"
        "    print('needs lightning')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["needs", "lightning"], out.stderr


def test_another_lightning_version_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_cloud.integrations import lightning

    monkeypatch.setattr(pl, "__version__", "2.7.0")
    monkeypatch.setattr(lightning, "_warned", False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DcpCloudCheckpointIO()
            DcpCloudModelParallelStrategy()
        messages = [str(w.message) for w in caught if "tested with pytorch-lightning" in str(w.message)]
        assert len(messages) == 1 and "2.6.6" in messages[0] and "2.7.0" in messages[0]
    finally:
        filesystem.unregister()
