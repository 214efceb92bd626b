"""``dcp.save(state, checkpoint_id="s3://...")`` through dcp_cloud: the switch for code that never builds a
writer or reader itself (frameworks that hand DCP a URL).

:func:`install` makes ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` called with a ``checkpoint_id`` of
``s3://``, ``gs://``, ``az://`` or an Azure blob URL, and no ``storage_writer`` / ``storage_reader``, use
:func:`~dcp_cloud.writer_for` / :func:`~dcp_cloud.reader_for` with the configs given to it (or the
environment's). Calls that pass their own writer or reader are untouched; local paths keep torch's
``FileSystemWriter`` unless ``local=True``. ``DCP_CLOUD_INSTALL=1`` installs it when ``dcp_cloud`` is
imported (``DCP_CLOUD_INSTALL=local`` with ``local=True``); ``import dcp_cloud.auto`` installs it too.
The one module that touches torch's private names does the patching (:mod:`dcp_cloud.format.torchprivate`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from ..dcp.factory import reader_for, writer_for
from ..errors import ConfigError, DcpCloudError, InvalidURIError
from ..format import torchprivate
from ..locations import SCHEMES, StoreConfig, config_scheme, scheme_of
from . import filesystem

log = logging.getLogger(__name__)

#: Environment variable read when dcp_cloud is imported: ``1`` installs the routing, ``local`` with
#: ``local=True``, anything else (or unset) leaves torch's own choice.
INSTALL_ENV = "DCP_CLOUD_INSTALL"


@dataclass(frozen=True)
class Routing:
    """What :func:`install` routes: the config per cloud scheme, and whether local paths come too."""

    configs: dict[str, StoreConfig]
    local: bool

    def choose(self, checkpoint_id: Any, reader: bool) -> Any:
        try:
            scheme = scheme_of(checkpoint_id)
        except InvalidURIError:
            return None
        if scheme == "file" and not self.local:
            return None
        if scheme not in SCHEMES:
            text = os.fspath(checkpoint_id)
            if "://" in str(text) and not _fsspec_serves(scheme):
                raise InvalidURIError(
                    f"no storage serves {scheme}:// ({text!r}): dcp_cloud serves "
                    + ", ".join(f"{s}://" for s in SCHEMES)
                    + " and torch finds no fsspec filesystem for it; fix the URI or pass a storage_writer/reader"
                )
            return None
        config = self.configs.get(scheme)
        return reader_for(checkpoint_id, config) if reader else writer_for(checkpoint_id, config)


def _fsspec_serves(scheme: str) -> bool:
    try:
        from fsspec.registry import get_filesystem_class
    except ImportError:
        return False
    try:
        get_filesystem_class(scheme)
    except (ImportError, ValueError):
        return False
    return True


_lock = threading.Lock()
_installed: Routing | None = None


def install(*configs: StoreConfig, local: bool = False, filesystems: bool = True) -> None:
    """Route ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with a cloud ``checkpoint_id`` and no storage
    writer or reader through dcp_cloud's writers and readers (process-wide; each rank calls it, or sets
    ``DCP_CLOUD_INSTALL=1``).

    ``configs``: at most one :class:`~dcp_cloud.S3Config`, :class:`~dcp_cloud.GCSConfig` and
    :class:`~dcp_cloud.AzureConfig`, used for the URIs of their cloud (without one, the environment's
    endpoint, region and credentials). ``local=True`` routes ``file://`` and plain paths to
    :class:`~dcp_cloud.LocalWriter` / :class:`~dcp_cloud.LocalReader` too. ``filesystems`` also serves fsspec's
    ``s3``, ``gs``/``gcs`` and ``az`` protocols with dcp_cloud's stores (:mod:`~dcp_cloud.integrations.filesystem`),
    so a framework's path operations next to its checkpoints (exists, listing, deleting old steps) work
    without s3fs, gcsfs or adlfs and with the same configs. Calling it again replaces the
    routing; :func:`uninstall` gives torch its own choice back. Raises ConfigError for a config that is
    not a store config or is given twice, and DcpCloudError if this torch chooses storage elsewhere."""
    global _installed
    by_scheme: dict[str, StoreConfig] = {}
    for config in configs:
        scheme = config_scheme(config)
        if scheme is None:
            raise ConfigError(f"install() takes S3Config, GCSConfig and AzureConfig, got {type(config).__name__}")
        if scheme in by_scheme:
            raise ConfigError(f"install() got two configs for {scheme}:// ({type(config).__name__}); pass one")
        by_scheme[scheme] = config
    routing = Routing(by_scheme, bool(local))
    with _lock:
        try:
            torchprivate.route_storage_setup(routing.choose)
        except RuntimeError as exc:
            raise DcpCloudError(str(exc)) from exc
        filesystem.unregister()
        if filesystems:
            filesystem.register(by_scheme)
        _installed = routing


def uninstall() -> None:
    """Undo :func:`install`: ``dcp.save`` / ``dcp.load`` choose their storage as stock torch does."""
    global _installed
    with _lock:
        torchprivate.unroute_storage_setup()
        filesystem.unregister()
        _installed = None


def installed() -> Routing | None:
    """The routing in force, or None."""
    return _installed if torchprivate.storage_routed() else None


def install_from_environment() -> None:
    """Install the routing if :data:`INSTALL_ENV` asks for it (called when dcp_cloud is imported)."""
    value = os.environ.get(INSTALL_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return
    if value not in ("1", "true", "yes", "on", "local"):
        log.warning("%s=%r is not 1 or local; dcp.save and dcp.load keep torch's own storage", INSTALL_ENV, value)
        return
    install(local=value == "local")


__all__ = ["INSTALL_ENV", "Routing", "install", "install_from_environment", "installed", "uninstall"]
