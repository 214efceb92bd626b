"""GCSConfig (how to reach GCS, picklable, free of credentials) and the resolution of credentials.

How credentials and the endpoint are chosen is described in the package docstring
(:mod:`dcp_cloud.store.gcs`)."""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from .objectopts import GCSObjectOptions

_SCOPES = (
    "https://www.googleapis.com/auth/devstorage.full_control",
    "https://www.googleapis.com/auth/devstorage.read_only",
    "https://www.googleapis.com/auth/devstorage.read_write",
)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class GCSConfig:
    """How to reach GCS. Everything here is picklable and free of credentials (a customer encryption key in
    ``object_options`` travels with it, pickled, but is never shown)."""

    #: Project for the client (billing/quota). ``None``: ``GOOGLE_CLOUD_PROJECT``
    #: or the project of the credentials. Bucket operations do not need one.
    project: str | None = None
    #: API endpoint, e.g. ``"http://127.0.0.1:4443"`` for an emulator or
    #: ``"https://storage-xyz.p.googleapis.com"`` for a private endpoint.
    #: ``None``: ``STORAGE_EMULATOR_HOST`` if set, else the public endpoint.
    #: An ``http://`` endpoint is used with anonymous credentials unless
    #: ``credentials_file`` (or ``credentials=``) is given.
    endpoint: str | None = None
    #: Path of a service-account or ADC JSON file, read in each process that
    #: uses the store (so it must exist there). ``None``: Application Default
    #: Credentials.
    credentials_file: str | None = None
    #: Send the CRC32C of every upload so the server rejects corrupted bytes,
    #: and verify whole-object downloads against the server's CRC32C.
    transport_checksums: bool = True
    #: How every object is written and every request made (CMEK, CSEK, requester pays, storage class; see
    #: :class:`~dcp_cloud.store.gcs.objectopts.GCSObjectOptions`). ``None``: the bucket's defaults.
    object_options: GCSObjectOptions | None = None

    def __post_init__(self) -> None:
        if self.project is not None:
            _require(
                isinstance(self.project, str) and bool(self.project.strip()),
                f"GCSConfig.project must be a non-empty string or None, got {self.project!r}",
            )
        if self.endpoint is not None:
            _require(isinstance(self.endpoint, str), f"GCSConfig.endpoint must be a string, got {self.endpoint!r}")
            parsed = urllib.parse.urlsplit(self.endpoint)
            _require(
                parsed.scheme in ("http", "https") and bool(parsed.netloc),
                f"GCSConfig.endpoint must look like 'https://host[:port]', got {self.endpoint!r}",
            )
            _require(
                not parsed.query and not parsed.fragment and parsed.path in ("", "/"),
                f"GCSConfig.endpoint must be a bare 'scheme://host[:port]' (no path or query), got {self.endpoint!r}",
            )
            object.__setattr__(self, "endpoint", self.endpoint.rstrip("/"))
        if self.credentials_file is not None:
            _require(
                isinstance(self.credentials_file, (str, os.PathLike)) and bool(str(self.credentials_file)),
                f"GCSConfig.credentials_file must be a path or None, got {self.credentials_file!r}",
            )
            object.__setattr__(self, "credentials_file", os.fspath(self.credentials_file))
        _require(
            isinstance(self.transport_checksums, bool),
            f"GCSConfig.transport_checksums must be a bool, got {self.transport_checksums!r}",
        )
        _require(
            self.object_options is None or isinstance(self.object_options, GCSObjectOptions),
            f"GCSConfig.object_options must be a GCSObjectOptions or None, got {type(self.object_options).__name__}",
        )
        if self.object_options is not None:
            self.object_options.check_endpoint(self.endpoint)


def _resolve_credentials(config: GCSConfig, credentials: Any) -> tuple[Any, str | None]:
    """(credentials or None for the library default, project or None) for a store built with
    ``config`` and the explicit ``credentials`` object, if any."""
    import google.auth
    from google.auth import exceptions as auth_exceptions
    from google.auth.credentials import AnonymousCredentials

    project = config.project or os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT")
    if credentials is not None:
        return credentials, project
    if config.credentials_file is not None:
        path = config.credentials_file
        if not os.path.isfile(path):
            raise ConfigError(
                f"GCSConfig.credentials_file {path!r} does not exist in this process (pid {os.getpid()}); "
                "it is read by every process that uses the store"
            )
        try:
            creds, file_project = google.auth.load_credentials_from_file(path, scopes=_SCOPES)
        except auth_exceptions.DefaultCredentialsError as exc:
            raise ConfigError(
                f"GCSConfig.credentials_file {path!r} is not a usable credentials file ({type(exc).__name__})"
            ) from exc
        return creds, project or file_project
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return None, project  # the client uses anonymous credentials against the emulator
    if config.endpoint and config.endpoint.startswith("http://"):
        return AnonymousCredentials(), project  # never send ADC tokens over plain HTTP
    try:
        creds, adc_project = google.auth.default(scopes=_SCOPES)
    except auth_exceptions.DefaultCredentialsError:
        if config.endpoint:
            return AnonymousCredentials(), project
        raise
    return creds, project or adc_project
