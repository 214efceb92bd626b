"""dcp_cloud: Amazon S3, Google Cloud Storage and Azure Blob Storage homes for PyTorch Distributed Checkpoint.

>>> import torch.distributed.checkpoint as dcp
>>> from dcp_cloud import S3Writer, S3Reader
>>> dcp.save(state_dict, storage_writer=S3Writer("s3://bucket/run/step-100"))  # doctest: +SKIP
>>> dcp.load(state_dict, storage_reader=S3Reader("s3://bucket/run/step-100"))  # doctest: +SKIP
"""

from __future__ import annotations

import logging

from .config import RetryConfig, TransferConfig
from .dcp.constructors.azure import AzureReader, AzureWriter
from .dcp.constructors.gcs import GCSReader, GCSWriter
from .dcp.constructors.local import LocalReader, LocalWriter
from .dcp.constructors.s3 import S3Reader, S3Writer
from .dcp.device.hostpool import free_staging_pool
from .dcp.device.stagingconfig import StagingConfig
from .dcp.factory import reader_for, writer_for
from .dcp.load.reader import CloudReader
from .dcp.save.writer import CloudWriter
from .dcp.typed import load, save, typed_errors
from .errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointInUseError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    DeviceCopyError,
    InvalidStepError,
    InvalidURIError,
    MissingMetricError,
    NotACheckpointError,
    NotARunError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StepExistsError,
    StepLostError,
    StepMismatchError,
    StoreError,
    ThrottledError,
    TransientStoreError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    UnsupportedOperationError,
)
from .format.safepickle import trust_metadata_classes
from .integrations.routing import install, install_from_environment, uninstall
from .maintenance import (
    CheckpointInfo,
    CopyReport,
    GCReport,
    InspectReport,
    Progress,
    RemoveReport,
    VerifyReport,
    copy_checkpoint,
    gc,
    inspect_checkpoint,
    list_checkpoints,
    remove_checkpoint,
    verify,
)
from .planner.load import ScaleLoadPlanner
from .planner.replicas import ReplicaMismatchError
from .planner.save import BalancedSavePlanner
from .run import CheckpointManager, LocalTier, PendingSave, RetentionPolicy, StepNaming, TierStats
from .safetensors import ExportReport, SafetensorsReader, export_safetensors
from .store.azure.config import AzureConfig
from .store.azure.objectopts import AzureObjectOptions
from .store.clients import close_clients
from .store.gcs.config import GCSConfig
from .store.gcs.objectopts import GCSObjectOptions
from .store.s3.config import S3Config
from .store.s3.objectopts import S3ObjectOptions
from .transfer.stats import TransferStats

logging.getLogger("dcp_cloud").addHandler(logging.NullHandler())
install_from_environment()

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "AzureConfig",
    "AzureObjectOptions",
    "AzureReader",
    "AzureWriter",
    "BalancedSavePlanner",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CloudReader",
    "CloudWriter",
    "ConfigError",
    "CopyReport",
    "CorruptCheckpointError",
    "DcpCloudError",
    "DeviceCopyError",
    "ExportReport",
    "GCReport",
    "GCSConfig",
    "GCSObjectOptions",
    "GCSReader",
    "GCSWriter",
    "InspectReport",
    "InvalidStepError",
    "InvalidURIError",
    "LocalReader",
    "LocalTier",
    "LocalWriter",
    "MissingMetricError",
    "NotACheckpointError",
    "NotARunError",
    "ObjectNotFoundError",
    "PendingSave",
    "PreconditionFailedError",
    "Progress",
    "RemoveReport",
    "ReplicaMismatchError",
    "RetentionPolicy",
    "RetryConfig",
    "S3Config",
    "S3ObjectOptions",
    "S3Reader",
    "S3Writer",
    "SafetensorsReader",
    "ScaleLoadPlanner",
    "StagingConfig",
    "StepExistsError",
    "StepLostError",
    "StepMismatchError",
    "StepNaming",
    "StoreError",
    "ThrottledError",
    "TierStats",
    "TransferConfig",
    "TransferStats",
    "TransientStoreError",
    "UnsupportedCheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedOperationError",
    "VerifyReport",
    "close_clients",
    "copy_checkpoint",
    "export_safetensors",
    "free_staging_pool",
    "gc",
    "inspect_checkpoint",
    "install",
    "list_checkpoints",
    "load",
    "reader_for",
    "remove_checkpoint",
    "save",
    "typed_errors",
    "uninstall",
    "verify",
    "trust_metadata_classes",
    "writer_for",
]
