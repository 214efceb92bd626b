"""The ``dcp-cloud`` command (also ``python -m dcp_cloud``): a thin layer over the public API.

Exit status: 0 on success; 1 when dcp_cloud reports an error (the message,
without a traceback, goes to stderr) or the demo's loaded state differs;
2 on usage errors (unknown options, a malformed URI); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

PROG = "dcp-cloud"

_DESCRIPTION = """\
Inspect and maintain PyTorch Distributed Checkpoints in S3, GCS or a directory.

URIs: s3://bucket/prefix, gs://bucket/prefix, file:///dir. Credentials and
endpoints come from the usual places (AWS_* variables and profiles,
Application Default Credentials, STORAGE_EMULATOR_HOST); --endpoint overrides
the endpoint.
"""

_EPILOG = """\
examples:
  dcp-cloud ls s3://my-bucket/run-7
  dcp-cloud verify s3://my-bucket/run-7/step-1000
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--endpoint", metavar="URL", help="S3 or GCS endpoint (an S3-compatible server, an emulator)")
    store.add_argument("--region", help="S3 region (default: AWS_REGION / the profile's)")
    store.add_argument("--project", help="GCS project (default: GOOGLE_CLOUD_PROJECT / ADC)")
    store.add_argument("-v", "--verbose", action="store_true", help="log what dcp_cloud does (INFO) to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ls = commands.add_parser(
        "ls",
        parents=[store],
        help="list the checkpoints under a prefix",
        description="List the checkpoints (committed or not) under URI, with their size and commit time.",
    )
    ls.add_argument("uri", metavar="URI", help="root prefix, e.g. s3://bucket/run-7 (or a whole bucket)")

    verify = commands.add_parser(
        "verify",
        parents=[store],
        help="read a checkpoint and check its checksums",
        description="Read every item of the committed checkpoint at URI and check the CRC32C checksums "
        "recorded at save time. Stops at the first mismatch (exit 1). Items saved without checksums "
        "are counted as unverified.",
    )
    verify.add_argument("uri", metavar="URI", help="checkpoint, e.g. s3://bucket/run-7/step-1000")

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
        help="save on N ranks and load on M ranks against an embedded server",
        description="Start an embedded S3 (moto) or GCS (fake-gcs-server) server on 127.0.0.1, train a small "
        "FSDP2-sharded model on N CPU ranks, save it with model and Adam state, load it on M ranks and "
        "check it is bitwise equal. Needs no cloud account; prints a table of bytes, time, memory and requests.",
    )
    demo.add_argument("--backend", choices=("s3", "gcs"), default="s3", help="which embedded server (default: s3)")
    demo.add_argument("--save-ranks", type=_positive_int, default=4, metavar="N", help="ranks that save (default: 4)")
    demo.add_argument("--load-ranks", type=_positive_int, default=3, metavar="M", help="ranks that load (default: 3)")
    demo.add_argument("--steps", type=_non_negative_int, default=2, metavar="K", help="training steps (default: 2)")
    demo.add_argument("--size-mb", type=_size_mb, default=1.0, metavar="MB", help="model parameters in MB (default: 1)")
    demo.add_argument("-v", "--verbose", action="store_true", help="log what dcp_cloud does (INFO) to stderr")
    return parser


def _store_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Store options for the URI's scheme; options of another store are a usage error."""
    scheme = args.uri.split("://", 1)[0].lower() if "://" in args.uri else ""
    given = {name: getattr(args, name) for name in ("endpoint", "region", "project") if getattr(args, name)}
    accepted = {
        "s3": {"endpoint": "endpoint_url", "region": "region"},
        "gs": {"endpoint": "endpoint", "project": "project"},
    }
    mapping = accepted.get(scheme, {})
    wrong = [f"--{name}" for name in given if name not in mapping]
    if wrong:
        raise _UsageError(f"{', '.join(wrong)} cannot be used with {scheme or 'this'}:// URIs")
    return {mapping[name]: value for name, value in given.items()}


class _UsageError(Exception):
    pass


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) if epoch is not None else "-"


def _cmd_ls(args: argparse.Namespace) -> int:
    from ..maintenance import list_checkpoints

    found = list_checkpoints(args.uri, **_store_kwargs(args))
    if not found:
        print(f"no checkpoints under {args.uri}")
        return 0
    rows = [("STATE", "OBJECTS", "SIZE", "SAVED (UTC)", "URI")]
    for info in found:
        rows.append(
            (
                "committed" if info.committed else "partial",
                str(info.object_count),
                _size(info.total_bytes),
                _when(info.save_time),
                info.uri,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]:<{widths[3]}}  {row[4]}")
    partial = sum(1 for info in found if not info.committed)
    if partial:
        print(f"{partial} partial checkpoint(s): saves that never committed (or are still running); see `{PROG} gc`")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..maintenance import verify

    report = verify(args.uri, **_store_kwargs(args))
    print(
        f"OK {report.uri}: {report.items_checked} item(s), {_size(report.bytes_verified)} match their checksums "
        f"({report.objects} object(s), {report.seconds:.2f}s)"
    )
    if report.items_unverified:
        print(f"{report.items_unverified} item(s) were saved without checksums and could not be verified")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from ..maintenance import gc

    report = gc(args.uri, older_than=args.older_than, dry_run=args.dry_run, **_store_kwargs(args))
    verb = "would " if report.dry_run else ""
    for key in report.aborted_uploads:
        print(f"{verb}abort upload  {report.url(key)}")
    for key in report.deleted_objects:
        print(f"{verb}delete        {report.url(key)}")
    for what, reason in report.skipped:
        print(f"kept            {report.url(what)}: {reason}")
    print(
        f"{'dry run: ' if report.dry_run else ''}{len(report.aborted_uploads)} upload(s) "
        f"{verb}{'be ' if verb else ''}aborted, {len(report.deleted_objects)} object(s) ({_size(report.freed_bytes)}) "
        f"{verb}{'be ' if verb else ''}deleted; {len(report.committed_checkpoints)} committed checkpoint(s) kept"
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    config = DemoConfig(
        backend=args.backend,
        save_ranks=args.save_ranks,
        load_ranks=args.load_ranks,
        steps=args.steps,
        size_mb=args.size_mb,
    )
    return run_demo(config)


_COMMANDS = {"ls": _cmd_ls, "verify": _cmd_verify, "gc": _cmd_gc, "demo": _cmd_demo}


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
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
        logging.getLogger("dcp_cloud").setLevel(logging.INFO)
    try:
        return _COMMANDS[args.command](args)
    except _UsageError as exc:
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
        from ..testing.multirank import RankFailedError

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
