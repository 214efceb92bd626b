"""MkDocs hook: publish the benchmark files that live beside the scripts, unchanged.

``benchmarks/README.md`` (the method), ``benchmarks/history/*.md`` (earlier runs) and
``benchmarks/img/*.png`` (the plots) stay where the scripts write and read them; this hook adds them to
the site under ``benchmarks/`` so the benchmark page can link to them and ``mkdocs build --strict``
checks those links like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent


def _external() -> Iterator[tuple[str, Path]]:
    """(path on the site, file in the repository) of every published benchmark file."""
    yield "benchmarks/scripts.md", ROOT / "benchmarks" / "README.md"
    for path in sorted((ROOT / "benchmarks" / "history").glob("*.md")):
        yield f"benchmarks/history/{path.name}", path
    for path in sorted((ROOT / "benchmarks" / "img").glob("*.png")):
        yield f"benchmarks/img/{path.name}", path


def on_files(files: Files, config: Any) -> Files:
    for uri, path in _external():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
