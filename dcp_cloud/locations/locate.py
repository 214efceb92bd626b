"""A checkpoint URI and one options object of its cloud become a :class:`Location`: the parsed URI and the
backend that opens its store.

Every entry point that takes a URI (the writers and readers, ``CheckpointManager``, the maintenance
functions, the ``dcp-cloud`` commands, safetensors export and loading) comes here, so the schemes, the
Azure blob URLs and the options each cloud takes are decided in one place:

* ``s3://bucket/prefix`` takes an :class:`~dcp_cloud.S3Config`;
* ``gs://bucket/prefix`` a :class:`~dcp_cloud.GCSConfig` and, in-process only, a google-auth
  ``credentials`` object;
* ``az://container/prefix`` (or ``https://<account>.blob.core.windows.net/container/prefix``) an
  :class:`~dcp_cloud.AzureConfig` and, in-process only, a ``credentials`` object (a key, SAS or token
  credential);
* ``file:///dir`` (or a plain path) takes none.

A fourth cloud adds its config type to :data:`StoreConfig`, a scheme to :data:`SCHEMES` and a branch to
:func:`backend_of`, with its backend in :mod:`dcp_cloud.locations.backends`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from ..errors import ConfigError, InvalidURIError
from ..uri import CheckpointURI, parse_uri, split_azure_url
from .backends import AzureBackend, Backend, GCSBackend, LocalBackend, S3Backend

if TYPE_CHECKING:
    from ..store.azure.config import AzureConfig
    from ..store.gcs.config import GCSConfig
    from ..store.s3.config import S3Config

#: The options of one cloud's store: ``S3Config`` for ``s3://``, ``GCSConfig`` for ``gs://``, ``AzureConfig``
#: for ``az://``.
StoreConfig = Union["S3Config", "GCSConfig", "AzureConfig"]

#: Every URI scheme a location can have.
SCHEMES: tuple[str, ...] = ("s3", "gs", "az", "file")

_CONFIG_CLASS = {"s3": "S3Config", "gs": "GCSConfig", "az": "AzureConfig"}


@dataclass(frozen=True)
class Location:
    """Where a checkpoint (or a run's root, or a whole bucket) lives, and the recipe that opens its store."""

    uri: CheckpointURI
    backend: Backend

    @property
    def scheme(self) -> str:
        return self.uri.scheme


def scheme_of(uri: str | os.PathLike[str]) -> str:
    """The scheme ``uri`` is served by (``https://<account>.blob...`` is ``az``, a plain path ``file``)."""
    text = os.fspath(uri)
    if not isinstance(text, str):
        raise InvalidURIError(f"checkpoint URI must be a string, got {type(text).__name__}")
    if split_azure_url(text) is not None:
        return "az"
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", text)
    return match.group(1).lower() if match else "file"


def backend_of(scheme: str, config: StoreConfig | None = None, *, credentials: Any = None) -> Backend:
    """The backend of a ``scheme://`` location with ``config`` (of that scheme's cloud) and ``credentials``
    (GCS and Azure only). ConfigError for options another cloud takes."""
    _check_config(scheme, config)
    if credentials is not None and scheme not in ("gs", "az"):
        raise ConfigError(
            f"credentials= is for gs:// and az:// locations; {scheme}:// takes its credentials from "
            + ("the standard AWS chain (environment, profile, instance role)" if scheme == "s3" else "nowhere")
        )
    if scheme == "s3":
        from ..store.s3.config import S3Config

        return S3Backend(config or S3Config())  # type: ignore[arg-type]
    if scheme == "gs":
        from ..store.gcs.config import GCSConfig

        return GCSBackend(config or GCSConfig(), credentials)  # type: ignore[arg-type]
    if scheme == "az":
        from ..store.azure.config import AzureConfig

        return AzureBackend(config or AzureConfig(), credentials)  # type: ignore[arg-type]
    if scheme == "file":
        return LocalBackend()
    raise InvalidURIError(f"{scheme}:// is not a checkpoint location; use one of {', '.join(SCHEMES)}")


def config_with(scheme: str, config: StoreConfig | None, **keywords: Any) -> StoreConfig | None:
    """``config``, or one made of the per-cloud constructor ``keywords`` (``endpoint_url=``, ``region=`` of
    ``S3Writer``; ``project=``, ``endpoint=`` of ``GCSWriter``; ``account=``, ``endpoint=`` of ``AzureWriter``)
    when they are given; ConfigError when both are."""
    given = {name: value for name, value in keywords.items() if value is not None}
    if not given:
        return config
    if config is not None:
        raise ConfigError(
            f"pass {'/'.join(keywords)} either as keywords or inside config={_CONFIG_CLASS[scheme]}(...), not both"
        )
    if scheme == "s3":
        from ..store.s3.config import S3Config

        return S3Config(**given)
    if scheme == "gs":
        from ..store.gcs.config import GCSConfig

        return GCSConfig(**given)
    from ..store.azure.config import AzureConfig

    return AzureConfig(**given)


def azure_endpoint(uri: str | os.PathLike[str], config: AzureConfig | None) -> tuple[Any, AzureConfig | None]:
    """``(uri, config)`` with an Azure blob URL ``https://<account>.blob.../container/prefix`` turned into
    ``az://container/prefix`` and its account's endpoint put into the config; anything else unchanged.
    ConfigError when the config names another endpoint."""
    split = split_azure_url(uri) if isinstance(os.fspath(uri), str) else None
    if split is None:
        return uri, config
    uri, url_endpoint = split
    given = config.endpoint if config is not None else None
    if given is not None and given.rstrip("/") != url_endpoint:
        raise ConfigError(
            f"the checkpoint URL names the endpoint {url_endpoint!r} but the endpoint {given!r} was given; "
            "give one of them"
        )
    if config is None:
        from ..store.azure.config import AzureConfig

        return uri, AzureConfig(endpoint=url_endpoint)
    return uri, dataclasses.replace(config, endpoint=url_endpoint)


def locate(
    uri: str | os.PathLike[str],
    config: StoreConfig | None = None,
    *,
    credentials: Any = None,
    whole_bucket: bool = False,
    schemes: tuple[str, ...] = SCHEMES,
) -> Location:
    """The location of ``uri`` with its cloud's ``config`` and ``credentials``.

    ``whole_bucket``: ``s3://bucket`` (no prefix) is a location too, as a root to list or collect.
    ``schemes``: the schemes the caller serves (InvalidURIError for another).
    """
    scheme = scheme_of(uri)
    _check_config(scheme, config)
    if scheme == "az":
        uri, config = azure_endpoint(uri, config)  # type: ignore[arg-type]
    parsed = parse_root(uri, schemes) if whole_bucket else parse_uri(uri, schemes)
    return Location(parsed, backend_of(parsed.scheme, config, credentials=credentials))


def parse_root(uri: str | os.PathLike[str], schemes: tuple[str, ...] = SCHEMES) -> CheckpointURI:
    """Like :func:`~dcp_cloud.uri.parse_uri`, but ``s3://bucket`` (a whole bucket) is allowed."""
    text = os.fspath(uri)
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://([^/]*)/*$", text) if isinstance(text, str) else None
    if match and match.group(1).lower() != "file" and match.group(2):
        probe = parse_uri(f"{text.rstrip('/')}/x", schemes)  # validates scheme and bucket name
        return CheckpointURI(probe.scheme, probe.bucket, "")
    return parse_uri(text, schemes)


def _check_config(scheme: str, config: Any) -> None:
    if config is None:
        return
    expected = _CONFIG_CLASS.get(scheme)
    if expected is None or type(config).__name__ != expected or not _is_store_config(config):
        raise ConfigError(
            f"{scheme}:// locations take "
            + (
                f"an {expected}"
                if expected and expected[0] in "AEIOU"
                else f"a {expected}"
                if expected
                else "no config"
            )
            + f", got {type(config).__name__}; the options of each cloud are S3Config (s3://), GCSConfig (gs://) "
            "and AzureConfig (az://)"
        )


def config_scheme(config: Any) -> str | None:
    """The scheme whose locations take ``config`` (``"s3"`` for an S3Config...), None for anything else."""
    if not _is_store_config(config):
        return None
    return next(scheme for scheme, name in _CONFIG_CLASS.items() if type(config).__name__ == name)


def _is_store_config(config: Any) -> bool:
    from ..store.azure.config import AzureConfig
    from ..store.gcs.config import GCSConfig
    from ..store.s3.config import S3Config

    return isinstance(config, (S3Config, GCSConfig, AzureConfig))
