"""The ``dcp-cloud`` command (also ``python -m dcp_cloud``): a thin layer over the public API.

Exit status: 0 on success; 1 when dcp_cloud reports an error (the message,
without a traceback, goes to stderr: a missing or uncommitted checkpoint, a
committed destination of ``cp`` without --overwrite, a checksum mismatch,
``rm`` refusing) or the demo's loaded state differs; 2 on usage errors
(unknown options, a malformed URI); 130 on Ctrl-C.

Every command takes --json (one JSON object on stdout instead of the table)
and -q/--quiet (no progress bars; bars are drawn on stderr only when it is
a terminal). The commands themselves live in :mod:`.commands`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import objectargs
from .commands import COMMANDS, PROG, UsageError

_DESCRIPTION = """\
Inspect and maintain PyTorch Distributed Checkpoints in S3, GCS, Azure Blob Storage or a directory.

URIs: s3://bucket/prefix, gs://bucket/prefix, az://container/prefix (or
https://ACCOUNT.blob.core.windows.net/container/prefix), file:///dir. Credentials
and endpoints come from the usual places (AWS_* variables and profiles,
Application Default Credentials, STORAGE_EMULATOR_HOST, AZURE_STORAGE_*
variables and DefaultAzureCredential); --endpoint overrides the endpoint.
"""

_EPILOG = """\
examples:
  dcp-cloud ls s3://my-bucket/run-7
  dcp-cloud steps s3://my-bucket/run-7 --keep-last 3
  dcp-cloud inspect s3://my-bucket/run-7/step-1000 --json
  dcp-cloud verify s3://my-bucket/run-7/step-1000
  dcp-cloud cp s3://my-bucket/run-7/step-1000 gs://other/run-7/step-1000
  dcp-cloud cp gs://other/run-7/step-1000 az://checkpoints/run-7/step-1000
  dcp-cloud export s3://my-bucket/run-7/step-1000 s3://my-bucket/hf/run-7 --prefix model. --dtype bf16
  dcp-cloud rm s3://my-bucket/run-7/step-500
  dcp-cloud gc s3://my-bucket/run-7 --older-than 86400 --dry-run
  dcp-cloud demo --save-ranks 4 --load-ranks 3

exit status: 0 ok, 1 error reported by dcp_cloud (or demo mismatch), 2 usage error
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def _size_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MB, got {text!r}") from None
    if not 0 < value <= 4096:
        raise argparse.ArgumentTypeError(f"expected a size in MB between 0 and 4096, got {text!r}")
    return value


_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
    "fp64": "float64",
    "float64": "float64",
}


def _dtype(text: str) -> str:
    value = _DTYPES.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(sorted(set(_DTYPES)))}, got {text!r}")
    return value


def _file_size(text: str) -> int:
    """A size such as ``5GB``, ``500MB``, ``2GiB`` or a number of bytes (as Hugging Face's max_shard_size)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    head = text.strip().upper().rstrip()
    number = head.rstrip("KMGIB")
    unit = head[len(number) :].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MB or 2GiB, got {text!r}") from None
    if not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("-v", "--verbose", action="store_true", help="log what dcp_cloud does (INFO) to stderr")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    output.add_argument("-q", "--quiet", action="store_true", help="no progress bars (drawn only on a terminal)")
    store = argparse.ArgumentParser(add_help=False, parents=[output])
    store.add_argument(
        "--endpoint", metavar="URL", help="S3, GCS or Azure endpoint (an S3-compatible server, an emulator)"
    )
    store.add_argument("--region", help="S3 region (default: AWS_REGION / the profile's)")
    store.add_argument("--project", help="GCS project (default: GOOGLE_CLOUD_PROJECT / ADC)")
    store.add_argument(
        "--account", help="Azure storage account (default: AZURE_STORAGE_ACCOUNT / the connection string)"
    )
    objectargs.add_arguments(store)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ls = commands.add_parser(
        "ls",
        parents=[store],
        help="list the checkpoints under a prefix",
        description="List the checkpoints (committed or not) under URI, with their size and commit time.",
    )
    ls.add_argument("uri", metavar="URI", help="root prefix, e.g. s3://bucket/run-7 (or a whole bucket)")
    ls.add_argument(
        "--deps",
        action="store_true",
        help="read each committed checkpoint's metadata and show which checkpoints it is based on (incremental)",
    )

    steps = commands.add_parser(
        "steps",
        parents=[store],
        help="show a run's steps: committed or not, kept or dropped (and why), what depends on what",
        description="Show the steps of the run under URI (a CheckpointManager's root): which are committed, which "
        "the retention rules keep and why (the newest step, the last K, every N-th, the best K by a metric, the "
        "base of a kept incremental step, a step a job is loading), which the next retention pass would drop, "
        "which steps each one references, its size, time and saved metadata. The rules are those recorded with "
        "the newest step, unless given here. Reads only.",
    )
    steps.add_argument("uri", metavar="URI", help="the run's root, e.g. s3://bucket/run-7")
    steps.add_argument("--keep-last", type=_positive_int, metavar="K", help="rule: keep the newest K steps")
    steps.add_argument(
        "--keep-every", type=_positive_int, metavar="N", help="rule: keep every step that is a multiple of N"
    )
    steps.add_argument("--keep-best", type=_positive_int, metavar="K", help="rule: keep the best K steps by --metric")
    steps.add_argument("--metric", metavar="NAME", help="key of the metric in the steps' saved metadata")
    steps.add_argument("--mode", choices=("min", "max"), default="min", help="best is the lowest (min) or highest")
    steps.add_argument(
        "--local",
        metavar="DIR",
        help="also show this node's local tier (LocalTier's path): its steps, and which are not drained to URI yet",
    )

    inspect = commands.add_parser(
        "inspect",
        parents=[store],
        help="show what a checkpoint holds",
        description="Show whether the checkpoint at URI is committed, its save id and time, ranks and objects, "
        "every tensor (shape, dtype, bytes, chunks), non-tensor items, checksum coverage and compression. "
        "Reads the listing and .metadata only.",
    )
    inspect.add_argument("uri", metavar="URI", help="checkpoint, e.g. s3://bucket/run-7/step-1000")

    verify = commands.add_parser(
        "verify",
        parents=[store],
        help="read a checkpoint and check its checksums",
        description="Read every item of the committed checkpoint at URI and check the CRC32C checksums "
        "recorded at save time. Stops at the first mismatch (exit 1). Items saved without checksums "
        "are counted as unverified.",
    )
    verify.add_argument("uri", metavar="URI", help="checkpoint, e.g. s3://bucket/run-7/step-1000")

    cp = commands.add_parser(
        "cp",
        parents=[output],
        help="copy a committed checkpoint to another place or store",
        description="Copy the committed checkpoint at SRC to DST (s3://, gs://, az:// or file:// at either end; "
        "endpoints and credentials from the environment: AWS_*, AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST, ADC, "
        "AZURE_STORAGE_*). Within one "
        "store the service copies the objects and they are read back to check their CRC32C; across stores they "
        "stream through this process in bounded memory, checked as they pass. DST's .metadata is written last and "
        "create-only: a committed DST is refused unless --overwrite.",
    )
    cp.add_argument("source", metavar="SRC", help="committed checkpoint to copy")
    cp.add_argument("destination", metavar="DST", help="where the copy goes")
    cp.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    cp.add_argument(
        "--no-verify", action="store_true", help="within one store: skip reading the copies back to check them"
    )
    cp.add_argument(
        "--standalone",
        action="store_true",
        help="copy an incremental checkpoint with the base objects it references, into a self-contained one",
    )
    objectargs.add_arguments(cp)  # to each end they apply to: the copy's new objects, a keyed source's reads

    export = commands.add_parser(
        "export",
        parents=[output],
        help="write a committed checkpoint as Hugging Face safetensors files",
        description="Write the tensors of the committed checkpoint at SRC as Hugging Face safetensors files under "
        "DST (model-00001-of-0000N.safetensors and model.safetensors.index.json; s3://, gs://, az:// or file:// at "
        "either end, endpoints and credentials from the environment). The bytes stream from the stored chunks into "
        "multipart uploads in bounded memory; the index is written last and create-only, so DST is never seen as "
        "a complete model before every file is in place. A model already at DST is refused unless --overwrite.",
    )
    export.add_argument("source", metavar="SRC", help="committed checkpoint to export")
    export.add_argument("destination", metavar="DST", help="directory of the safetensors files")
    export.add_argument(
        "--prefix", metavar="P", help="only the tensors whose name starts with P, with P stripped (e.g. model.)"
    )
    export.add_argument("--dtype", type=_dtype, help="cast floating-point tensors (bf16, fp16, fp32, fp64)")
    export.add_argument(
        "--max-file-size",
        type=_file_size,
        default=None,
        metavar="SIZE",
        help="bytes of tensor data per file, e.g. 5GB (the default), 500MB",
    )
    export.add_argument(
        "--dcp-sharding-info",
        action="store_true",
        help="record torch's DCP_SHARDING_INFO in every header (for torch's HuggingFaceStorageReader)",
    )
    export.add_argument(
        "--extra-file",
        action="append",
        default=[],
        metavar="PATH",
        help="a local file to upload beside the model, under its own name (e.g. config.json); repeatable",
    )
    export.add_argument("--overwrite", action="store_true", help="replace a model at DST")

    rm = commands.add_parser(
        "rm",
        parents=[store],
        help="remove a checkpoint (uncommit first, then its shards)",
        description="Remove the checkpoint at URI: .metadata first (readers then refuse it), then its shards and "
        "pending uploads. Rerun it after an interruption to finish. Refuses if the prefix holds anything but "
        "checkpoint objects, or if a committed checkpoint under --scan-root (default: URI's parent) references "
        "objects of this one.",
    )
    rm.add_argument("uri", metavar="URI", help="checkpoint, e.g. s3://bucket/run-7/step-500")
    rm.add_argument("--missing-ok", action="store_true", help="exit 0 when nothing is stored at URI")
    rm.add_argument("--scan-root", metavar="URI", help="where to look for checkpoints that reference this one")
    rm.add_argument("--no-dependents-check", action="store_true", help="do not read other checkpoints' metadata first")

    gc = commands.add_parser(
        "gc",
        parents=[store],
        help="remove what failed saves left behind",
        description="Abort stale multipart uploads, delete the shards of saves that never committed and "
        "shards of committed checkpoints that their metadata does not reference. Never touches "
        ".metadata, anything committed metadata references, or anything newer than --older-than.",
    )
    gc.add_argument("uri", metavar="URI", help="root prefix, e.g. s3://bucket/run-7")
    gc.add_argument(
        "--older-than",
        type=_seconds,
        default=3600.0,
        metavar="SECONDS",
        help="only remove what is older than this; must exceed your longest save (default: 3600)",
    )
    gc.add_argument("--dry-run", action="store_true", help="report what would be removed, change nothing")

    demo = commands.add_parser(
        "demo",
        parents=[output],
        help="save on N ranks and load on M ranks against an embedded server",
        description="Start an embedded S3 (moto), GCS (fake-gcs-server) or Azure (Azurite) server on 127.0.0.1, "
        "train a small "
        "FSDP2-sharded model on N CPU ranks, save it with model and Adam state, load it on M ranks and "
        "check it is bitwise equal. Needs no cloud account; prints a table of bytes, time, memory and requests.",
    )
    demo.add_argument(
        "--backend", choices=("s3", "gcs", "azure"), default="s3", help="which embedded server (default: s3)"
    )
    demo.add_argument("--save-ranks", type=_positive_int, default=4, metavar="N", help="ranks that save (default: 4)")
    demo.add_argument("--load-ranks", type=_positive_int, default=3, metavar="M", help="ranks that load (default: 3)")
    demo.add_argument("--steps", type=_non_negative_int, default=2, metavar="K", help="training steps (default: 2)")
    demo.add_argument("--size-mb", type=_size_mb, default=1.0, metavar="MB", help="model parameters in MB (default: 1)")
    return parser


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _short_failure(exc: BaseException) -> str:
    """A rank failure without the tracebacks: the last line of each rank's report."""
    failures = getattr(exc, "failures", None) or {}
    if not failures:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    head = str(exc).splitlines()[0]
    lines = [head]
    for rank, text in sorted(failures.items()):
        last = next((line for line in reversed(text.strip().splitlines()) if line.strip()), "?")
        lines.append(f"  rank {rank}: {last.strip()}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    from ..errors import DcpCloudError, InvalidURIError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return exc.code if isinstance(exc.code, int) else 2
    # Warnings always reach stderr (the library's NullHandler would swallow them: e.g. that a server could
    # not list multipart uploads); -v adds what dcp_cloud does.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    if args.verbose:
        logging.getLogger("dcp_cloud").setLevel(logging.INFO)
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        _error(str(exc))
        return 2
    except InvalidURIError as exc:
        _error(str(exc))
        return 2
    except DcpCloudError as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except Exception as exc:  # demo infrastructure: ranks, embedded servers
        from ..testing.ranks.multirank import RankFailedError

        names = {"MotoServerError", "EmulatorError", "DemoUnavailableError"}
        if isinstance(exc, RankFailedError) or type(exc).__name__ in names:
            _error(_short_failure(exc))
            return 1
        if isinstance(exc, ImportError) and args.command == "demo":
            _error(
                f"the demo needs the embedded test servers, which are not installed ({exc}); "
                "install them with: pip install 'dcp_cloud[testing]'"
            )
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
