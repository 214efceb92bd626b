"""The one place a URI becomes a store: a checkpoint URI (``s3://``, ``gs://``, ``az://`` or an Azure blob
URL, ``file://`` or a plain path) and one options object of its cloud (``S3Config``, ``GCSConfig``,
``AzureConfig``) give a :class:`Location` with the backend that opens its store (:func:`locate`), or the
opened store itself (:func:`open_location`). The writers, readers, ``CheckpointManager``, the maintenance
functions, the ``dcp-cloud`` commands and safetensors all come here."""

from .backends import AzureBackend, Backend, GCSBackend, LocalBackend, S3Backend
from .locate import (
    SCHEMES,
    Location,
    StoreConfig,
    azure_endpoint,
    backend_of,
    config_scheme,
    config_with,
    locate,
    parse_root,
    scheme_of,
)
from .opened import OpenedLocation, open_location

__all__ = [
    "SCHEMES",
    "AzureBackend",
    "Backend",
    "GCSBackend",
    "LocalBackend",
    "Location",
    "OpenedLocation",
    "S3Backend",
    "StoreConfig",
    "azure_endpoint",
    "backend_of",
    "config_scheme",
    "config_with",
    "locate",
    "open_location",
    "parse_root",
    "scheme_of",
]
