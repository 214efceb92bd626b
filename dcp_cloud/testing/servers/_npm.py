"""npm packages of the test servers (s3rver, Azurite): one cache directory outside the repository, one way
to install a pinned version into it and to find it there without installing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def cache_dir() -> str:
    """``$DCP_CLOUD_BENCH_CACHE``, or ``~/.cache/dcp-cloud-bench``."""
    return os.environ.get("DCP_CLOUD_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dcp-cloud-bench")


def prefix(name: str, version: str) -> str:
    """Where ``name@version`` is installed (its own npm prefix under the cache directory)."""
    return os.path.join(cache_dir(), f"{name}-{version}")


def installed(name: str, version: str, entry: tuple[str, ...]) -> str | None:
    """Path of the package's ``entry`` file (relative to its directory under node_modules), or None."""
    path = os.path.join(prefix(name, version), "node_modules", name, *entry)
    return path if os.path.exists(path) else None


def missing_reason(name: str, version: str, entry: tuple[str, ...], module: str) -> str | None:
    """Why ``name`` cannot run here (None when it can); ``module`` is the ``python -m`` that installs it."""
    if shutil.which("node") is None:
        return f"{name} needs node on PATH (https://nodejs.org)"
    if installed(name, version, entry) is None:
        return f"{name} {version} is not installed; run `python -m {module}` (needs npm)"
    return None


def install(name: str, version: str, entry: tuple[str, ...]) -> str:
    """Path of the entry file, installing ``name@version`` with npm into the cache directory if it is missing."""
    found = installed(name, version, entry)
    if found is not None:
        return found
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise RuntimeError(f"{name} needs node and npm on PATH (https://nodejs.org)")
    where = prefix(name, version)
    os.makedirs(where, exist_ok=True)
    print(f"installing {name}@{version} into {where} ...", file=sys.stderr, flush=True)
    subprocess.run(
        ["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", where, f"{name}@{version}"], check=True
    )
    found = installed(name, version, entry)
    if found is None:
        raise RuntimeError(f"npm installed {name}@{version} but {'/'.join(entry)} is not where expected under {where}")
    return found


__all__ = ["cache_dir", "install", "installed", "missing_reason", "prefix"]
