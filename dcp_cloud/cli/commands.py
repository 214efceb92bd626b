"""The commands of ``dcp-cloud``: each calls one public function and prints its report (a table, or --json)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from ..errors import ConfigError
from . import objectargs
from .bars import Bars

PROG = "dcp-cloud"


class UsageError(Exception):
    """A command line that parses but cannot be run (exit status 2)."""


def _object_options(args: argparse.Namespace, scheme: str) -> Any:
    try:
        return objectargs.object_options(args, scheme)
    except (objectargs.ObjectArgError, ConfigError) as exc:
        raise UsageError(str(exc)) from None


def store_config(args: argparse.Namespace, uri: str | None = None, *, strict: bool = True) -> Any:
    """The options of the URI's cloud from ``--endpoint``, ``--region``, ``--project``, ``--account`` and the
    bucket options (an ``S3Config``, ``GCSConfig`` or ``AzureConfig``; None when none is given); with
    ``strict``, options of another cloud are a usage error (otherwise they are not applied to this URI)."""
    from ..locations import config_with, scheme_of

    uri = args.uri if uri is None else uri
    scheme = scheme_of(uri)
    given = {name: getattr(args, name, None) for name in ("endpoint", "region", "project", "account")}
    given = {name: value for name, value in given.items() if value}
    accepted = {
        "s3": {"endpoint": "endpoint_url", "region": "region"},
        "gs": {"endpoint": "endpoint", "project": "project"},
        "az": {"endpoint": "endpoint", "account": "account"},
    }
    mapping = accepted.get(scheme, {})
    wrong = [f"--{name}" for name in given if name not in mapping]
    wrong += objectargs.misfits(args, scheme)
    if wrong and strict:
        raise UsageError(f"{', '.join(wrong)} cannot be used with {scheme or 'this'}:// URIs")
    keywords = {mapping[name]: value for name, value in given.items() if name in mapping}
    if scheme in ("s3", "gs", "az"):
        keywords["object_options"] = _object_options(args, scheme)
    try:
        return config_with(scheme, None, **keywords)
    except ConfigError as exc:  # options that cannot go together (an SSE-C key to an http:// endpoint)
        raise UsageError(str(exc)) from None


def size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) if epoch is not None else "-"


def _bars(args: argparse.Namespace) -> Bars:
    return Bars.for_terminal(quiet=args.quiet)


def _json(value: Any) -> None:
    def plain(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return obj.to_dict() if hasattr(obj, "to_dict") else dataclasses.asdict(obj)
        raise TypeError(f"cannot write {type(obj).__name__} as JSON")

    json.dump(value, sys.stdout, indent=2, default=plain)
    print()


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


# --------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    from ..maintenance import list_checkpoints

    found = list_checkpoints(args.uri, dependencies=args.deps, config=store_config(args))
    if args.json:
        _json({"root": args.uri, "checkpoints": found})
        return 0
    if not found:
        print(f"no checkpoints under {args.uri}")
        return 0
    rows = [("STATE", "OBJECTS", "SIZE", "SAVED (UTC)", "URI") + (("BASED ON",) if args.deps else ())]
    for info in found:
        state = "committed" if info.committed else "partial"
        row = (state, str(info.object_count), size(info.total_bytes), when(info.save_time), info.uri)
        rows.append(row + ((", ".join(info.depends_on) or "-",) if args.deps else ()))
    _table(rows, right=(1, 2))
    partial = sum(1 for info in found if not info.committed)
    if partial:
        print(f"{partial} partial checkpoint(s): saves that never committed (or are still running); see `{PROG} gc`")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..maintenance import verify

    report = verify(args.uri, progress=_bars(args), config=store_config(args))
    if args.json:
        _json(report)
        return 0
    print(
        f"OK {report.uri}: {report.items_checked} item(s), {size(report.bytes_verified)} match their checksums "
        f"({report.objects} object(s), {report.seconds:.2f}s)"
    )
    if report.items_unverified:
        print(f"{report.items_unverified} item(s) were saved without checksums and could not be verified")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from ..maintenance import gc

    report = gc(
        args.uri, older_than=args.older_than, dry_run=args.dry_run, progress=_bars(args), config=store_config(args)
    )
    if args.json:
        _json(report)
        return 0
    verb = "would " if report.dry_run else ""
    for key in report.aborted_uploads:
        print(f"{verb}abort upload  {report.url(key)}")
    for key in report.deleted_objects:
        print(f"{verb}delete        {report.url(key)}")
    for what, reason in report.skipped:
        print(f"kept            {report.url(what)}: {reason}")
    be = "be " if verb else ""
    print(
        f"{'dry run: ' if report.dry_run else ''}{len(report.aborted_uploads)} upload(s) "
        f"{verb}{be}aborted, {len(report.deleted_objects)} object(s) ({size(report.freed_bytes)}) "
        f"{verb}{be}deleted; {len(report.committed_checkpoints)} committed checkpoint(s) kept"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..maintenance import inspect_checkpoint

    report = inspect_checkpoint(args.uri, config=store_config(args))
    if args.json:
        _json(report)
        return 0
    if not report.committed:
        print(f"{report.uri}: NOT committed (no .metadata): a save that never finished, or is still running")
    else:
        print(
            f"{report.uri}: committed {when(report.save_time)} UTC, save id {report.save_id or '-'}, "
            f"DCP {report.version or '-'}"
        )
    print(f"{report.ranks} rank(s), {len(report.objects)} object(s), {size(report.total_bytes)} stored")
    print()
    _table(
        [("OBJECT", "SIZE", "REFERENCED")]
        + [(o.name, size(o.size), "yes" if o.referenced else "NO") for o in report.objects],
        right=(1,),
    )
    if not report.committed:
        return 0
    if report.tensors:
        print()
        rows = [("TENSOR", "SHAPE", "DTYPE", "BYTES", "CHUNKS", "STORED")]
        for t in report.tensors:
            shape = "x".join(str(n) for n in t.shape) or "scalar"
            rows.append((t.fqn, shape, t.dtype, size(t.nbytes), str(t.chunks), size(t.stored_bytes)))
        _table(rows, right=(3, 4, 5))
    if report.non_tensors:
        print()
        _table([("NON-TENSOR ITEM", "STORED")] + [(i.fqn, size(i.stored_bytes)) for i in report.non_tensors], (1,))
    print()
    share = 100.0 * report.items_with_checksums / report.items if report.items else 100.0
    codecs = ", ".join(f"{name} ({n} item(s))" for name, n in report.compression) or "none"
    print(f"checksums: {report.items_with_checksums} of {report.items} item(s) ({share:.0f}%); compression: {codecs}")
    print(
        f"total: {len(report.tensors)} tensor(s), {size(report.tensor_bytes)} in memory; "
        f"{len(report.non_tensors)} other item(s); {size(report.total_bytes)} stored"
    )
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    from ..locations import scheme_of
    from ..maintenance import copy_checkpoint

    ends = (scheme_of(args.source), scheme_of(args.destination))
    unused = set(objectargs.misfits(args, ends[0])) & set(objectargs.misfits(args, ends[1]))
    if unused:
        raise UsageError(f"{', '.join(sorted(unused))} apply to neither end's cloud ({ends[0]}://, {ends[1]}://)")
    report = copy_checkpoint(
        args.source,
        args.destination,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        standalone=args.standalone,
        progress=_bars(args),
        source_config=store_config(args, args.source, strict=False),
        destination_config=store_config(args, args.destination, strict=False),
    )
    if args.json:
        _json(report)
        return 0
    how = "server-side" if report.server_side else "streamed"
    print(
        f"copied {report.source} -> {report.destination}: {report.objects} object(s), "
        f"{size(report.bytes_copied)} ({how}, {report.seconds:.2f}s); {report.items_verified} item(s) verified"
        + (", replaced the committed checkpoint there" if report.overwrote else "")
    )
    if report.items_unverified:
        print(f"{report.items_unverified} item(s) could not be verified (saved without checksums, or --no-verify)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from ..safetensors import DEFAULT_MAX_FILE_SIZE, export_safetensors

    extra = {}
    for path in args.extra_file:
        try:
            extra[Path(path).name] = Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"--extra-file {path}: {exc.strerror or exc}") from None
    report = export_safetensors(
        args.source,
        args.destination,
        prefix=args.prefix,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        max_file_size=args.max_file_size or DEFAULT_MAX_FILE_SIZE,
        dcp_sharding_info=args.dcp_sharding_info,
        extra_files=extra,
        overwrite=args.overwrite,
        progress=_bars(args),
    )
    if args.json:
        _json(report)
        return 0
    print(
        f"exported {report.source} -> {report.destination}: {report.tensors} tensor(s) in {len(report.files)} "
        f"file(s), {size(report.data_bytes)} ({report.seconds:.2f}s)"
        + (", replaced the model there" if report.overwrote else "")
    )
    if report.skipped:
        print(f"{report.skipped} item(s) of the checkpoint left out (not tensors, or not selected)")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from ..maintenance import remove_checkpoint

    report = remove_checkpoint(
        args.uri,
        missing_ok=args.missing_ok,
        check_dependents=not args.no_dependents_check,
        scan_root=args.scan_root,
        progress=_bars(args),
        config=store_config(args),
    )
    if args.json:
        _json(report)
        return 0
    if not report.deleted_objects and not report.aborted_uploads:
        print(f"nothing to remove at {report.uri}")
        return 0
    state = "committed" if report.was_committed else "uncommitted"
    print(
        f"removed {report.uri} ({state}): {len(report.deleted_objects)} object(s), {size(report.freed_bytes)}"
        + (f", {len(report.aborted_uploads)} upload(s) aborted" if report.aborted_uploads else "")
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    config = DemoConfig(
        backend=args.backend,
        save_ranks=args.save_ranks,
        load_ranks=args.load_ranks,
        steps=args.steps,
        size_mb=args.size_mb,
    )
    return run_demo(config, progress=_bars(args), as_json=args.json)


def _policy(args: argparse.Namespace) -> Any:
    from ..errors import ConfigError
    from ..run import RetentionPolicy

    rules = {"keep_last": args.keep_last, "keep_every": args.keep_every, "keep_best": args.keep_best}
    if args.metric is not None:
        rules["best_metric"] = args.metric
    if not any(v is not None for v in rules.values()):
        return None
    try:
        return RetentionPolicy(**rules, best_mode=args.mode)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def cmd_steps(args: argparse.Namespace) -> int:
    from ..run import CheckpointManager

    with CheckpointManager(args.uri, retention=_policy(args), config=store_config(args)) as mgr:
        report = mgr.describe()
    if args.json:
        _json(report)
        return 0
    if not report.steps:
        print(
            f"no steps under {args.uri}"
            + (f" (other checkpoints: {', '.join(report.others)})" if report.others else "")
        )
        if getattr(args, "local", None):
            _local_tier(args.local, set())
        return 0
    rows = [("STEP", "STATE", "SIZE", "SAVED (UTC)", "BASED ON", "KEPT BECAUSE", "METADATA")]
    for s in report.steps:
        if s.state == "partial":
            why = "a save that never committed (or is running)"
        else:
            why = ", ".join(s.kept) if s.kept else "-> dropped by the next retention pass"
        based = ", ".join(str(r) for r in s.references) or "-"
        meta = json.dumps(s.metadata, sort_keys=True) if s.metadata else "-"
        rows.append((str(s.step), s.state, size(s.total_bytes), when(s.saved_at), based, why, meta))
    _table(rows, right=(0, 2))
    policy = report.retention.describe()
    print(f"retention: {policy} ({report.retention_source}); the newest step and the bases of kept steps always stay")
    if report.others:
        print(f"not steps of this run (left alone): {', '.join(report.others)}")
    if getattr(args, "local", None):
        _local_tier(args.local, {s.step for s in report.steps if s.state == "committed"})
    return 0


def _local_tier(path: str, remote: set[int]) -> None:
    """This node's local tier: each step, committed here or not, and drained to the root or not (yet: a step
    ``drain_every`` skips, or one whose drain waits)."""
    from ..run.steps.naming import StepNaming
    from ..run.tiers.listing import scan

    found = sorted(scan(path, StepNaming()).values(), key=lambda s: s.step)
    print(f"local tier {path}: " + ("no steps" if not found else f"{len(found)} step(s)"))
    if not found:
        return
    rows = [("STEP", "HERE", "SIZE", "OBJECT STORE")]
    for s in found:
        here = "committed" if s.committed else "partial"
        there = "drained" if s.drained or s.step in remote else ("not drained" if s.committed else "-")
        rows.append((str(s.step), here, size(sum(s.files.values())), there))
    _table(rows, right=(0, 2))


COMMANDS = {
    "ls": cmd_ls,
    "steps": cmd_steps,
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "cp": cmd_cp,
    "export": cmd_export,
    "rm": cmd_rm,
    "gc": cmd_gc,
    "demo": cmd_demo,
}
