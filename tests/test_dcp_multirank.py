"""DCP on real gloo process groups: FSDP2 + Adam saved on 4 ranks, loaded on 1 (no group), 2, 3 and 4.

The 2-rank group also reshards the row-sharded checkpoint into column shards.

The reference is the full (gathered) state recorded on rank 0 at save time;
every load gathers what it loaded and must match it bit for bit. Typed errors
must reach ``except`` on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dcp_cloud.testing.ranks.multirank import run_ranks, run_single

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROWS = 1001  # rows of the first layer: uneven shards over 2, 3 and 4 ranks
OUT = 3  # rows of the last layer: on 4 ranks, rank 3 holds an empty shard
TIMEOUT = 900.0  # per launched group; generous: spawn + torch import dominate on a loaded machine
META = {"epoch": 3, "name": "run-ä", "lrs": [0.1, 0.01], "done": False}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, ROWS), torch.nn.ReLU(), torch.nn.Linear(ROWS, OUT))


def _blank_meta() -> dict[str, Any]:
    """Same keys as META (DCP loads only the keys the target has), other values."""
    return {"epoch": -1, "name": "", "lrs": [], "done": None}


def _extra() -> torch.Tensor:
    return torch.linspace(-1, 1, 37, dtype=torch.float64)


def _sharded(world_size: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = _model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Gathered model + optimizer state (a collective; the values land on rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optim": optim_sd}


def _make(kind: str, name: str, uri: str, **kw: Any) -> Any:
    import dcp_cloud

    cls = {("w", "s3"): dcp_cloud.S3Writer, ("w", "gcs"): dcp_cloud.GCSWriter, ("w", "azure"): dcp_cloud.AzureWriter,
           ("r", "s3"): dcp_cloud.S3Reader, ("r", "gcs"): dcp_cloud.GCSReader,
           ("r", "azure"): dcp_cloud.AzureReader}[(kind, name)]  # fmt: skip
    return cls(uri, **kw)


def _load_sharded(world_size: int, name: str, uri: str) -> dict[str, Any]:
    """Load into a fresh FSDP2 model + Adam on this group; return the gathered result (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _sharded(world_size, seed=1234)  # different values than the saved ones
    model_sd, optim_sd = get_state_dict(model, optim)  # initialises Adam's state to load into
    state = {"model": model_sd, "optim": optim_sd, "extra": torch.zeros(37, dtype=torch.float64), "meta": _blank_meta()}
    dcp.load(state, storage_reader=_make("r", name, uri))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full_state(model, optim)
    full.update(extra=state["extra"], meta=state["meta"])
    return full


def _save_then_load_on_4(rank: int, world_size: int, name: str, uri: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dcp_cloud
    from dcp_cloud import CheckpointExistsError

    model, optim = _sharded(world_size, seed=0)
    torch.manual_seed(100 + rank)  # each rank trains on its own batch
    for _ in range(2):
        loss = model(torch.randn(5, 12)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    assert model_sd["0.weight"].to_local().shape[0] == (251 if rank < 3 else 248)  # uneven shards
    assert model_sd["2.weight"].to_local().shape[0] == (1 if rank < 3 else 0)  # rank 3: empty shard
    writer = _make("w", name, uri)
    dcp.save({"model": model_sd, "optim": optim_sd, "extra": _extra(), "meta": dict(META)}, storage_writer=writer)
    reference = _full_state(model, optim)
    reference.update(extra=_extra(), meta=dict(META))
    assert writer.stats.bytes_written > 0
    loaded = _load_sharded(world_size, name, uri)
    try:  # in a group the constructor raises nothing: the save's first step raises it on every rank
        dcp_cloud.save({"w": torch.zeros(1)}, storage_writer=_make("w", name, uri))
        exists = "no error"
    except CheckpointExistsError as exc:
        exists = type(exc).__name__
    return {"reference": reference, "loaded": loaded, "exists": exists} if rank == 0 else {"exists": exists}


def _load_on_group(rank: int, world_size: int, name: str, uri: str) -> dict[str, Any] | None:
    loaded = _load_sharded(world_size, name, uri)
    return loaded if rank == 0 else None


def _load_columns(world_size: int, name: str, uri: str) -> dict[str, Any]:
    """Reshard the row-sharded checkpoint into column shards: strided byte runs of every saved chunk."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_cloud import TransferConfig

    mesh = init_device_mesh("cpu", (world_size,))

    def cols(rows: int, n: int) -> Any:
        return distribute_tensor(torch.zeros(rows, n), mesh, [Shard(1)])

    state = {
        "model": {"0.weight": cols(ROWS, 12)},
        "optim": {"state": {"2.weight": {"exp_avg": cols(OUT, ROWS)}}},
    }
    dcp.load(state, storage_reader=_make("r", name, uri))
    # Small checksum blocks and no coalescing: runs widened to blocks, verified piecewise.
    fine = {"optim": {"state": {"0.weight": {"exp_avg": cols(ROWS, 12)}}}}
    dcp.load(
        fine, storage_reader=_make("r", name, uri, transfer=TransferConfig(checksum_block_size=4096, coalesce_gap=0))
    )
    return {
        "0.weight": state["model"]["0.weight"].full_tensor(),
        "2.weight.exp_avg": state["optim"]["state"]["2.weight"]["exp_avg"].full_tensor(),
        "0.weight.exp_avg": fine["optim"]["state"]["0.weight"]["exp_avg"].full_tensor(),
    }


def _load_and_errors_on_2(rank: int, world_size: int, name: str, uri: str, missing: str, late: str) -> dict[str, Any]:
    """Load on 2 ranks, then check that typed errors reach ``except`` on every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import dcp_cloud
    from dcp_cloud import CheckpointExistsError, CheckpointNotFoundError

    loaded = _load_sharded(world_size, name, uri)
    columns = _load_columns(world_size, name, uri)
    caught: dict[str, str] = {}
    state = {"w": torch.zeros(4)}

    def expect(label: str, exc_type: type[BaseException], call: Any) -> None:
        try:
            call()
            caught[label] = "no error"
        except exc_type as exc:
            caught[label] = type(exc).__name__
        except BaseException as exc:  # noqa: BLE001 - report what arrived instead
            caught[label] = f"wrong: {type(exc).__name__}: {exc}"

    # Loading a checkpoint that does not exist: found by the constructor, and by reset(); in a group both
    # are raised by the load's first step on every rank (plain dcp: wrapped; dcp_cloud.load: typed).
    expect(
        "missing-ctor", CheckpointNotFoundError, lambda: dcp_cloud.load(state, storage_reader=_make("r", name, missing))
    )
    expect("missing-plain", CheckpointException, lambda: dcp.load(state, storage_reader=_make("r", name, missing)))
    reader = _make("r", name, uri)
    expect(
        "missing-reset",
        CheckpointNotFoundError,
        lambda: dcp_cloud.load(state, checkpoint_id=missing, storage_reader=reader),
    )
    # Saving over an existing checkpoint: found by the constructor, and by reset().
    expect("exists-ctor", CheckpointExistsError, lambda: dcp_cloud.save(state, storage_writer=_make("w", name, uri)))
    writer = _make("w", name, late)
    expect(
        "exists-reset", CheckpointExistsError, lambda: dcp_cloud.save(state, checkpoint_id=uri, storage_writer=writer)
    )
    # ... and when it was committed by someone else after this save's writers were made:
    # then the commit itself fails (inside torch's collective) and dcp_cloud.save unwraps it.
    writer = _make("w", name, late)
    dist.barrier()
    if rank == 0:
        dcp.save({"other": torch.ones(1)}, storage_writer=_make("w", name, late), no_dist=True)
    dist.barrier()
    expect("exists-commit", CheckpointExistsError, lambda: dcp_cloud.save(state, storage_writer=writer))
    return {"loaded": loaded if rank == 0 else None, "columns": columns if rank == 0 else None, "caught": caught}


def _load_unsharded(name: str, uri: str) -> dict[str, Any]:
    """Load into a plain model + Adam in a process without any process group."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    assert not dist.is_initialized()
    model = _model(seed=4321)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "extra": torch.zeros(37, dtype=torch.float64), "meta": _blank_meta()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=_make("r", name, uri))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "extra": state["extra"], "meta": state["meta"]}


def _check(actual: dict[str, Any], reference: dict[str, Any], assert_same: Any) -> None:
    assert set(actual["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert reference["model"]["0.weight"].shape == (ROWS, 12)
    assert set(reference["optim"]["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(reference["optim"]["state"]["0.weight"]["step"]) == 2.0
    assert_same(actual, reference)


# On S3 only: planning and reads are the same code on every store, and the heaviest multi-rank test here
# need not repeat on each (GCS and Azure load resharded on many ranks in the fuzzer's tiers and test_interop).
@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_fsdp2_adam_saved_on_4_loads_on_1_2_3_4(backend, assert_same) -> None:
    uri = backend.uri("fsdp/step-2")
    env = backend.child_env
    results = run_ranks(4, _save_then_load_on_4, backend.name, uri, env=env, timeout=TIMEOUT)
    assert [r["exists"] for r in results] == ["CheckpointExistsError"] * 4  # typed, on every rank
    saved = results[0]
    reference = saved["reference"]
    assert reference["meta"] == META
    _check(saved["loaded"], reference, assert_same)
    shards = [k for k in backend.keys(uri) if k.endswith(".distcp")]
    assert len(shards) == 4, backend.keys(uri)

    _check(run_single(_load_unsharded, backend.name, uri, env=env, timeout=TIMEOUT), reference, assert_same)
    _check(run_ranks(3, _load_on_group, backend.name, uri, env=env, timeout=TIMEOUT)[0], reference, assert_same)

    missing, late = backend.uri("fsdp/never-saved"), backend.uri("fsdp/late")
    out = run_ranks(2, _load_and_errors_on_2, backend.name, uri, missing, late, env=env, timeout=TIMEOUT)
    _check(out[0]["loaded"], reference, assert_same)
    assert_same(
        out[0]["columns"],
        {
            "0.weight": reference["model"]["0.weight"],
            "2.weight.exp_avg": reference["optim"]["state"]["2.weight"]["exp_avg"],
            "0.weight.exp_avg": reference["optim"]["state"]["0.weight"]["exp_avg"],
        },
    )
    expected = {
        "missing-ctor": "CheckpointNotFoundError",
        "missing-plain": "CheckpointException",
        "missing-reset": "CheckpointNotFoundError",
        "exists-ctor": "CheckpointExistsError",
        "exists-reset": "CheckpointExistsError",
        "exists-commit": "CheckpointExistsError",
    }
    for rank in range(2):
        assert out[rank]["caught"] == expected, (rank, out[rank]["caught"])
    # The losing save left no committed change: the winner's checkpoint is intact.
    assert len([k for k in backend.keys(late) if k.endswith(".distcp")]) >= 1


def _retry_with_the_same_readers(rank: int, world_size: int, name: str, uri: str, shared: bool) -> dict[str, Any]:
    """Save, then a load that fails on rank 1 as its read_data starts (its transfer engine cannot start, once:
    no server can make that happen) while the other ranks read theirs, or wait in the shared reads' exchange;
    then the load again, with the same readers on every rank (torch calls no reset() without a checkpoint_id)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_cloud.dcp.load.reader import CloudReader

    values = {f"w{r}": torch.full((64,), float(r + 1)) for r in range(world_size)}
    dcp.save({"both": torch.arange(5.0), f"w{rank}": values[f"w{rank}"]}, storage_writer=_make("w", name, uri))
    reader = _make("r", name, uri, share_reads=shared)
    if rank == 1:
        original = CloudReader._engine

        def fails_once(self: Any, *args: Any) -> Any:
            CloudReader._engine = original  # type: ignore[method-assign]
            raise RuntimeError("can't start new thread")

        CloudReader._engine = fails_once  # type: ignore[method-assign]
    state = {"both": torch.zeros(5), f"w{rank}": torch.zeros(64)}
    try:
        dcp.load(state, storage_reader=reader)
        first = "no error"
    except CheckpointException as exc:
        first = "rank 1" if 1 in exc.failures else f"other ranks: {sorted(exc.failures)}"
    dcp.load(state, storage_reader=reader)  # the same reader, on every rank
    return {"first": first, "ok": bool(torch.equal(state[f"w{rank}"], values[f"w{rank}"]))}


#: The reader's retry logic is the same on every store: Azure (the third backend) leaves it to S3 and GCS, to keep
#: CI short (two more 3-rank runs, about 45 s each here).
@pytest.mark.parametrize("backend", ["s3", "gcs"], indirect=True)
@pytest.mark.parametrize("shared", [False, True], ids=["own-reads", "shared-reads"])
def test_a_failed_load_retried_with_the_same_readers_loads(backend, shared: bool) -> None:
    """The failing rank's error reaches every rank at once, also where the others wait for it in the shared reads'
    exchange; and every rank reads the metadata anew for the retry, or none does (where the ranks that finished
    the failed load and the one that did not disagreed, the retry's metadata broadcast would wait for the
    group's timeout)."""
    uri = backend.uri(f"retry-{'shared' if shared else 'own'}")
    out = run_ranks(3, _retry_with_the_same_readers, backend.name, uri, shared, env=backend.child_env, timeout=180)
    assert [r["first"] for r in out] == ["rank 1"] * 3, out
    assert all(r["ok"] for r in out), out
