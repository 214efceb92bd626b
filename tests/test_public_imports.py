"""Every name that was public before the code was split into one module per concern (issue #15)
is still importable from where it was, and the transfer engine does not depend on the upload stream."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

import dcp_cloud

#: Public names per module as of the split: ``dcp_cloud.__all__``, and the names without a
#: leading underscore defined or re-exported at module level in the modules that became packages.
PUBLIC: dict[str, tuple[str, ...]] = {
    "dcp_cloud": (
        "AccessDeniedError", "AzureReader", "AzureWriter", "BalancedSavePlanner", "BucketNotFoundError",
        "CheckpointExistsError",
        "CheckpointInfo", "CheckpointNotFoundError", "ChecksumMismatchError", "CloudReader", "CloudWriter",
        "ConfigError", "CorruptCheckpointError", "DcpCloudError", "GCReport", "GCSReader", "GCSWriter",
        "InvalidURIError", "LocalReader", "LocalWriter", "ObjectNotFoundError", "PreconditionFailedError",
        "ReplicaMismatchError", "RetryConfig", "S3Reader", "S3Writer", "StoreError", "TransferConfig",
        "TransferStats", "TransientStoreError", "VerifyReport", "gc", "list_checkpoints", "load", "save",
        "typed_errors", "verify",
    ),
    "dcp_cloud.store.s3": ("MiB", "GiB", "S3_PART_LIMITS", "S3Config", "S3ObjectOptions", "S3Store"),
    "dcp_cloud.store.gcs": (
        "MiB", "TiB", "PARTS_MARKER", "COMPOSE_MAX_SOURCES", "GCSConfig", "GCSObjectOptions", "GCSStore",
    ),
    "dcp_cloud.store.azure": (
        "AZURE_PART_LIMITS", "MAX_BLOCKS", "MAX_BLOCK_SIZE", "MAX_PUT_BLOB_SIZE", "AzureConfig",
        "AzureObjectOptions", "AzureStore", "check_container",
    ),
    "dcp_cloud.testing.proxy": (
        "FAULT_KINDS", "FaultEvent", "FaultPlan", "FaultProxy", "ProxyProtocolError", "ProxyStats", "RequestInfo",
        "Shaping", "TLSFiles", "TrafficCount", "make_test_tls", "server_context",
    ),
    "dcp_cloud.maintenance": ("CheckpointInfo", "GCReport", "VerifyReport", "gc", "list_checkpoints", "verify", "log"),
    "dcp_cloud.transfer.engine": ("T", "split_outs", "TransferEngine"),
    "dcp_cloud.transfer.upload": ("MIN_BORROWED_WRITE", "ObjectWriter", "log", "open_writer"),
    # The pytest plugin (entry point ``dcp_cloud``): its fixtures and constants.
    "dcp_cloud.testing.plugin": (
        "MOTO_MIN_PART_SIZE", "MOTO_PART_LIMITS", "moto_client", "moto_s3_client", "moto_server", "s3_bucket",
        "s3_env", "s3_store", "gcs_bucket", "gcs_emulator", "gcs_env", "gcs_store", "azurite_server", "azure_env",
        "azure_container", "azure_store",
    ),
}  # fmt: skip

#: Private names the tests import by these module paths.
USED_BY_TESTS: dict[str, tuple[str, ...]] = {
    "dcp_cloud.store.s3": ("_translate",),
    "dcp_cloud.store.gcs": ("_translate",),
    "dcp_cloud.store.azure": ("_translate",),
}


def _pairs(table: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    return [(module, name) for module, names in table.items() for name in names]


@pytest.mark.parametrize(("module", "name"), _pairs(PUBLIC) + _pairs(USED_BY_TESTS))
def test_name_importable_from_its_old_module(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    assert hasattr(mod, name), f"{module}.{name} is gone"


def test_package_all_keeps_every_name() -> None:
    assert set(dcp_cloud.__all__) >= set(PUBLIC["dcp_cloud"]), "a public name left dcp_cloud.__all__"


def test_old_all_lists_still_hold() -> None:
    from dcp_cloud import maintenance
    from dcp_cloud.store import gcs, s3
    from dcp_cloud.testing import proxy

    assert set(s3.__all__) >= {"S3_PART_LIMITS", "S3Config", "S3Store"}
    assert set(gcs.__all__) >= {"GCSConfig", "GCSObjectOptions", "GCSStore"}
    assert set(proxy.__all__) >= {
        "FAULT_KINDS", "FaultEvent", "FaultPlan", "FaultProxy", "ProxyStats", "RequestInfo", "TrafficCount"
    }  # fmt: skip
    assert set(maintenance.__all__) >= {
        "CheckpointInfo", "GCReport", "VerifyReport", "gc", "list_checkpoints", "verify"
    }  # fmt: skip


def test_gc_is_the_function_not_a_module() -> None:
    """A submodule named ``gc`` would replace the function on the package once imported."""
    from dcp_cloud import maintenance

    for value in (dcp_cloud.gc, maintenance.gc):
        assert callable(value) and not isinstance(value, types.ModuleType)
    assert dcp_cloud.gc is maintenance.gc
    assert maintenance.list_checkpoints is dcp_cloud.list_checkpoints
    assert maintenance.verify is dcp_cloud.verify


def _imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` imports anywhere (top level, TYPE_CHECKING, inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_transfer_engine_does_not_import_the_upload_stream() -> None:
    """upload.py builds on engine.py; engine.py importing upload.py would make the two a cycle."""
    from dcp_cloud.transfer import engine

    imported = _imported_modules(Path(engine.__file__), "dcp_cloud.transfer")
    assert "dcp_cloud.transfer.engine" not in imported  # sanity: names are resolved, not raw
    assert "dcp_cloud.store.retry" in imported  # sanity: relative imports are seen
    assert "dcp_cloud.transfer.upload" not in imported


def test_open_writer_uploads_through_the_engine() -> None:
    from dcp_cloud import RetryConfig, TransferConfig
    from dcp_cloud.store.memory import MemoryStore
    from dcp_cloud.transfer.engine import TransferEngine
    from dcp_cloud.transfer.upload import ObjectWriter, open_writer

    store = MemoryStore()
    with TransferEngine(store, TransferConfig(), RetryConfig()) as engine:
        writer = open_writer(engine, "obj", 11, create_only=True)
        assert isinstance(writer, ObjectWriter)
        writer.write(b"hello world")
        writer.commit()
    assert store.get("obj") == b"hello world"


def test_nothing_below_the_run_layer_imports_it() -> None:
    """run/ sits above dcp/ and maintenance/: only the package's root and the command line import it."""
    root = Path(dcp_cloud.__file__).parent
    importers = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("run", "cli") or rel == Path("__init__.py"):
            continue
        package = ".".join(("dcp_cloud", *rel.parent.parts))
        if any(
            name == "dcp_cloud.run" or name.startswith("dcp_cloud.run.") for name in _imported_modules(path, package)
        ):
            importers.append(str(rel))
    assert importers == []
    run_imports = _imported_modules(root / "run" / "manager.py", "dcp_cloud.run")
    assert "dcp_cloud.run.steps.view" in run_imports  # sanity: relative imports inside run/ are seen


#: The modules outside ``store/azure/`` and ``testing/`` that may know Azure exists, and why (the store boundary:
#: a backend is one folder plus its rows in these tables).
AZURE_ALLOWED = {
    "dcp_cloud/__init__.py": "exports AzureWriter / AzureReader / AzureConfig / AzureObjectOptions",
    "dcp_cloud/dcp/constructors/azure.py": "the public constructors, as for every backend",
    "dcp_cloud/dcp/factory.py": "writer_for / reader_for: the az row of the constructor table",
    "dcp_cloud/integrations/routing.py": "docstring: the URLs install() routes",
    "dcp_cloud/integrations/filesystem.py": "AzureFileSystem, the fsspec filesystem of each cloud",
    "dcp_cloud/cli/objectargs.py": "the bucket options of each cloud: AzureObjectOptions among them",
    "dcp_cloud/store/optioncheck.py": "docstring: the object options of each cloud the checks serve",
    "dcp_cloud/integrations/lightning.py": "the fsspec filesystem class of each cloud; AzureConfig among the configs",
    "dcp_cloud/locations/__init__.py": "docstring: the URIs and configs of the location seam",
    "dcp_cloud/locations/locate.py": "the location seam: Azure blob URLs and AzureConfig, once",
    "dcp_cloud/locations/backends.py": "AzureBackend, the picklable recipe that opens the store in each process",
    "dcp_cloud/uri.py": "the URI table: az:// and Azure blob URLs",
    "dcp_cloud/maintenance/__init__.py": "docstring: the az:// store options",
    "dcp_cloud/maintenance/copying.py": "docstring: az:// among cp's ends, AzureConfig among the configs",
    "dcp_cloud/cli/commands.py": "docstring: the config the CLI's options make",
    "dcp_cloud/cli/main.py": "the CLI's help texts and options",
    "dcp_cloud/cli/demo.py": "dcp-cloud demo --backend azure",
    "dcp_cloud/cli/demoservers.py": "dcp-cloud demo --backend azure: its embedded Azurite",
    "dcp_cloud/run/manager.py": "docstring: AzureConfig among the configs",
    "dcp_cloud/safetensors/export.py": "docstring: AzureConfig among the configs",
    "dcp_cloud/safetensors/reader.py": "docstring: AzureConfig among the configs",
    "dcp_cloud/store/clients.py": "AZURE_* variables decide how a shared client is built",
    "dcp_cloud/store/protocol.py": "docstrings: which backend declares which capability",
}


def test_azure_stays_behind_the_store_boundary() -> None:
    """Nothing outside store/azure/, the fixtures and the tables above mentions Azure; store/azure/ imports
    nothing above store/."""
    root = Path(dcp_cloud.__file__).parent
    mentions = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith(("dcp_cloud/store/azure/", "dcp_cloud/testing/")):
            continue
        if "azure" in path.read_text().lower():
            mentions.add(rel)
    assert mentions == set(AZURE_ALLOWED), sorted(mentions ^ set(AZURE_ALLOWED))
    for path in (root / "store" / "azure").glob("*.py"):
        imported = _imported_modules(path, "dcp_cloud.store.azure")
        above = sorted(
            m
            for m in imported
            if m.startswith("dcp_cloud.") and not m.startswith(("dcp_cloud.store", "dcp_cloud.errors"))
        )
        assert not above, f"{path.name} imports {above}"
