"""Checkpoint URIs: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``, ``file:///dir``.

Azure's blob URLs (``https://<account>.blob.core.windows.net/container/prefix``) are accepted where ``az``
is: :func:`split_azure_url` turns one into ``az://container/prefix`` and the account's endpoint.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass

from .errors import CorruptCheckpointError, InvalidURIError

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


@dataclass(frozen=True)
class CheckpointURI:
    """A parsed checkpoint location: the bucket and the key prefix of the checkpoint."""

    scheme: str
    bucket: str
    prefix: str

    def key(self, name: str) -> str:
        """The object key of ``name`` inside the checkpoint (``../step-1000/x`` resolves to a sibling's object)."""
        return join_key(self.prefix, name)

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def join_key(prefix: str, relative: str) -> str:
    """The bucket key of ``relative`` (a storage record's path) under the checkpoint ``prefix``.

    An incremental checkpoint's records name objects of earlier checkpoints as
    ``../step-1000/__0_<token>.distcp``; such a path is normalized
    (``run/step-2000/../step-1000/x`` is ``run/step-1000/x``), since object
    stores do not resolve ``..`` in keys. A path that leaves the bucket (or
    the local root) raises CorruptCheckpointError.
    """
    key = f"{prefix}/{relative}" if prefix else relative
    if ".." not in relative and not relative.startswith("/"):
        return key
    normal = posixpath.normpath(key)
    if relative.startswith("/") or normal == ".." or normal.startswith("../") or normal.startswith("/"):
        raise CorruptCheckpointError(
            f"the storage record path {relative!r} of the checkpoint at {prefix!r} points outside its bucket; "
            "the metadata is damaged or was edited"
        )
    return normal


def split_azure_url(uri: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(az://container/prefix, endpoint)`` of an Azure blob URL ``https://<account>.blob.<suffix>/container/
    prefix`` (public, sovereign and private-link endpoints alike), or None for anything else.

    A URL with a query (a SAS token pasted with it) raises InvalidURIError: the token must not travel in a
    URI that is logged and recorded; put it in ``AZURE_STORAGE_SAS_TOKEN``.
    """
    text = os.fspath(uri)
    if not isinstance(text, str):
        return None
    match = re.match(r"^https://([a-z0-9]{3,24})\.blob\.([a-z0-9.-]+)(/[^?#]*)?([?#].*)?$", text, re.IGNORECASE)
    if match is None:
        return None
    if match.group(4):
        raise InvalidURIError(
            "an Azure blob URL with a query or fragment (a SAS token?) cannot be a checkpoint URI: it would be "
            "logged and recorded; give the URL without it and put the token in AZURE_STORAGE_SAS_TOKEN"
        )
    account, suffix, path = match.group(1).lower(), match.group(2).lower(), (match.group(3) or "")
    return f"az://{path.lstrip('/')}", f"https://{account}.blob.{suffix}"


def _azure_container_problem(name: str) -> str | None:
    from .store.azure.config import container_problem

    return container_problem(name)


def parse_uri(uri: str | os.PathLike[str], schemes: tuple[str, ...]) -> CheckpointURI:
    """Parse ``uri`` and check its scheme is one of ``schemes``.

    Where ``file`` is among ``schemes``, a plain path (``/dir/ckpt``,
    ``ckpt``) means ``file://`` of its absolute path.

    Raises InvalidURIError for a malformed URI (``s3:/x``), a missing bucket
    or key prefix (``gs://``, ``s3://bucket``) or a scheme the class does not
    serve (``gs://`` given to an S3 class).
    """
    text = os.fspath(uri)
    if not isinstance(text, str):
        raise InvalidURIError(f"checkpoint URI must be a string, got {type(text).__name__}")
    expected = " or ".join(f"{s}://" for s in schemes)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]+:/?(?!/)", text) and "://" not in text:  # s3:/x, gs:bucket
        raise InvalidURIError(
            f"malformed checkpoint URI {text!r}: expected {expected}<bucket>/<prefix>, "
            f"e.g. {schemes[0]}://my-bucket/run-7/step-1000"
        )
    if "az" in schemes:
        azure = split_azure_url(text)
        if azure is not None:
            text = azure[0]  # the account's endpoint is taken by the writer/reader when it is built
    if "file" in schemes and text and "://" not in text:
        text = "file://" + os.path.abspath(text)  # a plain directory path, as stock FileSystemWriter takes
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$", text)
    if match is None:
        raise InvalidURIError(
            f"malformed checkpoint URI {text!r}: expected {expected}<bucket>/<prefix>, "
            f"e.g. {schemes[0]}://my-bucket/run-7/step-1000"
        )
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in schemes:
        raise InvalidURIError(
            f"checkpoint URI {text!r} has scheme {scheme}:// but this class serves {expected}; "
            "use the writer/reader class for that store"
        )
    if scheme == "file":
        path = os.path.abspath("/" + rest.lstrip("/"))
        root, name = os.path.split(path.rstrip("/"))
        if not name:
            raise InvalidURIError(f"checkpoint URI {text!r} names no directory")
        return CheckpointURI("file", root, name)
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise InvalidURIError(f"checkpoint URI {text!r} names no bucket: expected {scheme}://<bucket>/<prefix>")
    if scheme == "az":
        problem = _azure_container_problem(bucket)
        if problem is not None:
            raise InvalidURIError(
                f"checkpoint URI {text!r}: {bucket!r} is not a valid Azure container name ({problem}); "
                "e.g. az://checkpoints/run-7/step-1000"
            )
    elif not _BUCKET.match(bucket):
        raise InvalidURIError(
            f"checkpoint URI {text!r}: {bucket!r} is not a valid bucket name "
            "(3-222 characters: lowercase letters, digits, '.', '-', '_')"
        )
    if not prefix:
        raise InvalidURIError(
            f"checkpoint URI {text!r} has an empty key: give each checkpoint its own prefix, "
            f"e.g. {scheme}://{bucket}/run-7/step-1000"
        )
    if "//" in prefix:
        raise InvalidURIError(f"checkpoint URI {text!r} has an empty path segment ('//')")
    return CheckpointURI(scheme, bucket, prefix)
