"""One fuzz case on one rank: the phases, their oracle checks, and the report sent back to the launcher.

Phases (each on the first ``w1`` or ``w2`` ranks of the world, or on rank 0 alone):

1. ``stock save``: stock ``FileSystemWriter`` saves the case's state (save layout, ``w1`` ranks);
2. ``stock load``: stock ``FileSystemReader`` loads it into the load layout (``w2`` ranks): the
   expected leaves; they must also equal the values the case was built from (else the *oracle* is
   wrong: a generator bug, or a torch one). A layout stock torch cannot save or load is held plainly
   there (:mod:`fuzz_oracle`); our run holds it as drawn where it can, and expects the values the case
   was built from for it;
3. ``base save`` (incremental cases): our writer saves the base (other values of the changed items);
   ``earlier save`` (overwrite cases): our writer saves those other values where the state will go;
   ``first save`` (writer_reuse cases that do not overwrite): they are saved elsewhere, by the writer
   that the case's save then reuses (overwrite cases reuse the earlier save's writer);
4. ``save``: our writer saves the state (``dcp.save``, or ``dcp.async_save`` through the staging
   pool, scribbling over the state once it is staged); incremental cases pass ``base=``, overwrite
   cases ``overwrite=True``;
5. ``load``: our reader loads it into a fresh load layout: must equal the expected leaves bitwise
   (partial_load cases: a part of the state; reader_reuse cases: twice with the same reader, the second
   time the whole state, a reader which in overwrite cases loaded the earlier save before the
   overwrite, and once more after a base overwrite);
6. ``download`` (rank 0): every object of the case copied to disk with a plain SDK;
7. ``stock load of ours``: stock ``FileSystemReader`` loads the downloaded copy into the oracle's
   layouts: must equal what stock loaded of its own;
8. ``incremental bytes`` (rank 0): the incremental save stored about the changed items' bytes only;
9. ``leftovers`` (overwrite cases, rank 0): no object of the earlier save is left beside the state;
   ``copy`` (copy cases, rank 0): ``verify`` of the checkpoint, ``copy_checkpoint`` of it beside it or to
   a local directory (standalone where incremental), ``verify`` of the copy (it must check the same items
   and bytes as the original's); ``load of the copy``: our
   reader loads the copy, which must equal the expected leaves too;
10. ``base overwrite`` and ``load after base overwrite`` (overwrite and incremental cases): other
    values saved over the base with overwrite=True; the state must still load as expected;
11. ``gc`` (rank 0) and ``load after gc`` (cleanup="gc" cases): gc of the case's root, after which the
    state (and its copy) must load as expected; ``rm`` (cleanup="rm", rank 0): removing the base of an
    incremental case is refused, removing the state leaves no object, and then so does the base's.

After every phase the ranks exchange their errors over the world, so that one rank's failure
ends the case on every rank (a phase that hangs is the launcher's deadline's business).
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fuzz_targets as targets
import fuzz_tiers
import torch.distributed as dist
from fuzz_cases import Case, partial
from fuzz_options import Target, by_scope
from fuzz_oracle import Exclusions, exclusions, held_plainly
from fuzz_state import BASE, FILLER, FINAL, build, differences, identities, scribble, snapshot_state

#: Bytes an incremental save may store beyond the changed items, per object it writes (index footer,
#: alignment) and in all; measured footers of the fuzzer's objects stay under a few hundred bytes.
FOOTER_SLACK_PER_OBJECT = 4096
INCREMENTAL_SLACK = 4096
_TRACE_LINES = 40


@dataclass
class RankReport:
    rank: int
    #: The errors of the first phase that failed, on any rank (every rank reports all of them).
    error: str = ""
    failed_phase: str = ""
    #: One line per leaf or property that differs from the oracle.
    mismatches: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


def _given(values: dict[str, Any]) -> dict[str, Any]:
    from fuzz_options import _Default

    return {k: v for k, v in values.items() if not isinstance(v, _Default)}


class CaseRun:
    def __init__(
        self, ranks: Any, case: Case, target: Target, case_id: str, workdir: str, stock_only: bool = False
    ) -> None:
        self.ranks, self.target, self.case_id = ranks, target, case_id
        #: Run stock's save and load of the case as drawn, nothing else (does stock torch run these layouts?).
        self.stock_only = stock_only
        self.excluded = Exclusions({}, {}) if stock_only else exclusions(case)
        #: The case our run saves and loads: as drawn, but for the layouts no torch planner can hold.
        self.case = held_plainly(case, self.excluded.ours)
        #: The case stock torch runs (the oracle): every layout it cannot hold held plainly.
        self.oracle = held_plainly(case, self.excluded.stock)
        self.work = Path(workdir)
        self.rank = ranks.rank
        self.report = RankReport(self.rank)
        #: What our loads must give: stock's leaves, or the built values where stock cannot load the layout.
        self.expected: dict[str, Any] = {}
        #: What stock's load of its own checkpoint gave (the oracle case's layouts).
        self.stock_expected: dict[str, Any] = {}
        self.incremental = bool(case.opt("incremental"))
        self.overwrite = bool(case.opt("overwrite"))
        self._kept_reader: Any = None  # the load's reader, kept for a later load with it (reader_reuse)
        self.reuse_writer = bool(case.opt("writer_reuse"))
        self._kept_writer: Any = None  # the writer of an earlier save that the case's save reuses
        self.ours = targets.case_uri(target, case_id, "ours")
        self.base = targets.case_uri(target, case_id, "base")
        self.local = self.work / "download" if target.kind != "local" else Path(target.root, case_id)
        if target.kind == "local":  # a local checkpoint's parent directory is its "bucket": it must exist
            self.local.mkdir(parents=True, exist_ok=True)

    # -- options --------------------------------------------------------------------------------------
    def _writer(self, uri: str, **extra: Any) -> Any:
        import dcp_cloud

        c = self.case
        kw = _given(by_scope(c.options, "writer"))
        if "base" in extra:  # the drawn hashes= is the base's; the incremental save keeps its default
            kw.pop("hashes", None)
        kw.update(extra)
        transfer = dcp_cloud.TransferConfig(**targets.transfer_kwargs(self.target, _given(c.save_transfer)))
        staging = dcp_cloud.StagingConfig(**_given(by_scope(c.options, "staging")))
        store = by_scope(c.options, self.target.kind)  # S3Config or GCSConfig keywords
        return targets.writer(self.target, uri, store, transfer=transfer, staging=staging, **kw)

    @property
    def no_dist(self) -> bool:
        return bool(self.case.opt("no_dist")) and self.case.w2 == 1

    def _reader(self, uri: str, target: Target | None = None) -> Any:
        import dcp_cloud

        target = target or self.target
        c = self.case
        transfer = dcp_cloud.TransferConfig(**targets.transfer_kwargs(target, _given(c.load_transfer)))
        kw = _given(by_scope(c.options, "reader"))
        kw["staging"] = dcp_cloud.StagingConfig(**_given(by_scope(c.options, "staging")))
        if self.no_dist:
            kw.update(share_metadata=False, process_group=None)
        else:
            kw.update(process_group=self.ranks.groups[c.w2])
        return targets.reader(target, uri, by_scope(c.options, target.kind), transfer=transfer, **kw)

    def _planner(self) -> Any:
        from dcp_cloud import BalancedSavePlanner

        choice = self.case.opt("planner")
        if choice == "balanced":
            return BalancedSavePlanner()
        if choice == "balanced_split":
            return BalancedSavePlanner(min_chunk_bytes=256)
        return None

    # -- phases ---------------------------------------------------------------------------------------
    def stock_save(self) -> None:
        import torch.distributed.checkpoint as dcp

        state = build(self.oracle, "save", FINAL, self.ranks)
        writer = dcp.FileSystemWriter(str(self.work / "stock"), sync_files=False)
        dcp.save(state, storage_writer=writer, process_group=self.ranks.groups[self.case.w1])

    def _load(
        self, reader: Any, api: str = "dcp", no_dist: bool = False, part: bool = False, case: Case | None = None
    ) -> dict[str, Any]:
        """Load into a fresh load layout of ``case`` (default: the case's; ``part``: of the partial_load items
        only); the leaves loaded."""
        import torch.distributed.checkpoint as dcp

        import dcp_cloud

        case = case or (self.part if part else self.case)
        target = build(case, "load", FILLER, self.ranks)
        before = identities(case, target)
        load = dcp_cloud.load if api == "dcp_cloud" else dcp.load
        where = {"no_dist": True} if no_dist else {"process_group": self.ranks.groups[self.case.w2]}
        load(target, storage_reader=reader, **where)
        return snapshot_state(case, target, before)

    @property
    def part(self) -> Case:
        """What a partial load asks for (:func:`fuzz_cases.partial`)."""
        return partial(self.case)

    def stock_load(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.stock_expected = self._load(dcp.FileSystemReader(str(self.work / "stock")), case=self.oracle)
        truth = snapshot_state(self.oracle, build(self.oracle, "load", FINAL, self.ranks), None)
        plain = {k: v[:-1] if v[0] in ("tensor", "shards") else v for k, v in self.stock_expected.items()}
        what = f"ORACLE (stock torch vs the values the case was built from), rank {self.rank}"
        self.report.mismatches += differences(plain, truth, what)
        self.expected = dict(self.stock_expected)
        unlike = {".".join(map(str, path)) for path in self.excluded.checked_against_built}
        if unlike:  # our load layout is not stock's: the values the case was built from, loaded in place
            built = snapshot_state(self.case, build(self.case, "load", FINAL, self.ranks), None)
            self.expected.update({key: (*built[key], "in place") for key in unlike})

    def _save(self, uri: str, which: str, writer: Any = None, checkpoint_id: str | None = None, **extra: Any) -> None:
        """Save the ``which`` values to ``uri`` with a new writer, or with ``writer`` (reused: ``checkpoint_id``
        is passed to dcp.save, which resets it, or None: it goes on at the URI it has)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        state = build(self.case, "save", which, self.ranks)
        writer = writer if writer is not None else self._writer(uri, **extra)
        how = {"storage_writer": writer, "planner": self._planner(), "process_group": self.ranks.groups[self.case.w1]}
        if checkpoint_id is not None:
            how["checkpoint_id"] = checkpoint_id
        if not self.case.opt("async_save"):
            dcp.save(state, **how)
            return
        response = dcp.async_save(state, **how)
        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.result()
            response = response.upload_completion
        scribble(self.case, state)  # training goes on: the checkpoint must hold the staged values
        response.result()

    def base_save(self) -> None:
        self._save(self.base, BASE)

    def _save_extra(self) -> dict[str, Any]:
        """The writer keywords of the case's save (beyond the drawn ones)."""
        extra: dict[str, Any] = {"overwrite": True} if self.overwrite else {}
        if self.incremental:
            extra["base"] = self.base
        return extra

    def earlier_save(self) -> None:
        if self.reuse_writer:  # the writer of the case's save, which goes on at the same URI (no reset)
            self._kept_writer = self._writer(self.ours, **self._save_extra())
        self._save(self.ours, BASE, writer=self._kept_writer)

    def first_save(self) -> None:
        """The other values saved elsewhere by the writer the case's save reuses (writer_reuse)."""
        first = targets.case_uri(self.target, self.case_id, "first")
        self._kept_writer = self._writer(first, **self._save_extra())
        self._save(first, BASE, writer=self._kept_writer)

    def earlier_load(self) -> None:
        """A load of the earlier save by the reader the case's load reuses (its values are not the oracle's)."""
        self._kept_reader = self._reader(self.ours)
        self._load(self._kept_reader, self.case.opt("api"), self.no_dist)

    def save(self) -> None:
        if self._kept_writer is not None:  # reused: to another URI through dcp.save's checkpoint_id
            self._save(self.ours, FINAL, self._kept_writer, None if self.overwrite else self.ours)
        else:
            self._save(self.ours, FINAL, **self._save_extra())

    def base_overwrite(self) -> None:
        self._save(self.base, FINAL, overwrite=True)

    def load(self) -> None:
        from dcp_cloud.dcp.load.sharedreads import COUNTS

        reuse = bool(self.case.opt("reader_reuse"))
        reader = self._kept_reader if reuse and self._kept_reader is not None else self._reader(self.ours)
        landed = sum(COUNTS.values())
        for turn in range(2 if reuse else 1):
            part = bool(self.case.opt("partial_load")) and not turn
            got = self._load(reader, self.case.opt("api"), self.no_dist, part)
            what = f"our {'second ' if turn else ''}load{' (reader reused)' if reuse else ''}, rank {self.rank}"
            want = {k: self.expected[k] for k in got} if part else self.expected
            self.report.mismatches += differences(got, want, what)
        self._kept_reader = reader
        # items this rank landed from another rank's fetch (read sharing): the fuzzer says how often it ran
        self.report.facts["shared"] = sum(COUNTS.values()) - landed

    def download(self) -> None:
        targets.download(self.target, self.case_id, self.local)

    def stock_load_ours(self) -> None:
        import torch.distributed.checkpoint as dcp

        got = self._load(dcp.FileSystemReader(str(self.local / "ours")), case=self.oracle)
        what = f"stock load of our download, rank {self.rank}"
        self.report.mismatches += differences(got, self.stock_expected, what)

    def incremental_bytes(self) -> None:
        """The incremental save stored about the bytes of the changed items, whatever the base was saved with."""
        import torch.distributed.checkpoint as dcp

        if self.case.opt("hashes") is False:
            # hashes=False: the base recorded no content hashes, so nothing can be skipped; the save
            # must still be correct (checked by the loads), but uploading everything is right here.
            return
        records = dcp.FileSystemReader(str(self.local / "base")).read_metadata().storage_data
        changed = {".".join(map(str, it.path)) for it in self.case.items if it.changed or it.kind != "tensor"}
        need = sum(int(info.length) for index, info in records.items() if index.fqn in changed)
        skippable = sum(int(info.length) for index, info in records.items() if index.fqn not in changed)
        stored, files = targets.stored_bytes(self.local / "ours")
        allowed = need + FOOTER_SLACK_PER_OBJECT * files + INCREMENTAL_SLACK
        # Whether the check could fail at all: storing the unchanged items too would exceed the bound.
        discriminating = stored + skippable > allowed
        self.report.facts.update(
            stored=stored, changed=need, unchanged=skippable, objects=files, discriminating=discriminating
        )
        if stored > allowed:
            self.report.mismatches.append(
                f"incremental save stored {stored} bytes in {files} objects, but its changed items take {need} "
                f"(allowed {allowed}); {skippable} bytes of unchanged items were in the base "
                f"(base saved with hashes={self.case.opt('hashes')!r})"
            )

    @property
    def _copy_target(self) -> Target:
        if self.case.opt("copy") == "to_disk":
            return Target("disk", "local", str(self.work / "copies"))
        return self.target

    def copy(self) -> None:
        import dcp_cloud

        store = targets.store_config(self.target, by_scope(self.case.options, self.target.kind))
        dest = self._copy_target
        dest_store = targets.store_config(dest, by_scope(self.case.options, dest.kind))
        copied = targets.case_uri(dest, self.case_id, "copy")
        if dest.kind == "local":
            Path(copied).parent.mkdir(parents=True, exist_ok=True)
        checked = dcp_cloud.verify(self.ours, config=store)
        if self.case.opt("checksums") is not False and checked.items_unverified:
            self.report.mismatches.append(f"verify: items saved with checksums on have none: {checked}")
        dcp_cloud.copy_checkpoint(
            self.ours, copied, source_config=store, destination_config=dest_store, standalone=self.incremental
        )
        copy_checked = dcp_cloud.verify(copied, config=dest_store)
        same = ("items_checked", "items_unverified", "bytes_verified")
        if any(getattr(copy_checked, name) != getattr(checked, name) for name in same):
            self.report.mismatches.append(f"verify of the copy: {copy_checked}; of the original: {checked}")

    def load_copy(self) -> None:
        dest = self._copy_target
        reader = self._reader(targets.case_uri(dest, self.case_id, "copy"), dest)
        got = self._load(reader, self.case.opt("api"), self.no_dist)
        self.report.mismatches += differences(got, self.expected, f"our load of the copy, rank {self.rank}")

    def leftovers(self) -> None:
        """After an overwrite, the checkpoint's directory holds its ``.metadata`` and the objects it names."""
        import torch.distributed.checkpoint as dcp

        where = self.local / "ours"
        records = dcp.FileSystemReader(str(where)).read_metadata().storage_data
        named = {os.path.normpath(where / info.relative_path) for info in records.values()}
        stored = {os.path.normpath(p) for p in where.rglob("*") if p.is_file() and p.name != ".metadata"}
        left = sorted(os.path.relpath(p, where) for p in stored - named)
        if left:
            self.report.mismatches.append(f"overwrite left {len(left)} object(s) of the earlier save: {left[:5]}")

    def _store(self) -> Any:
        return targets.store_config(self.target, by_scope(self.case.options, self.target.kind))

    def gc(self) -> None:
        import dcp_cloud

        dcp_cloud.gc(targets.case_root(self.target, self.case_id), older_than=0, config=self._store())

    def after_gc(self) -> None:
        self.load()
        if self.case.opt("copy"):
            self.load_copy()

    def rm(self) -> None:
        """rm refuses a base that a checkpoint of the case uses (and removes one none uses); each removal
        leaves nothing behind."""
        import torch.distributed.checkpoint as dcp

        import dcp_cloud

        # the case's checkpoints that may reference the base: its own, and the first save of a reused writer
        names = ["ours"] + (["first"] if self.reuse_writer and not self.overwrite else [])
        uses_base = self.incremental and any(
            str(info.relative_path).startswith("../")
            for name in names
            for info in dcp.FileSystemReader(str(self.local / name)).read_metadata().storage_data.values()
        )
        if uses_base:
            try:
                dcp_cloud.remove_checkpoint(self.base, config=self._store())
            except dcp_cloud.CheckpointInUseError:
                pass
            else:
                self.report.mismatches.append("rm of the base succeeded while a checkpoint references it")
                return
        elif self.incremental:  # e.g. a base saved with hashes=False: nothing was referenced, all uploaded
            self._remove(self.base, "base")
        for name in names:
            self._remove(targets.case_uri(self.target, self.case_id, name), name)
        if uses_base:  # no dependent now
            self._remove(self.base, "base")

    def _remove(self, uri: str, name: str) -> None:
        import dcp_cloud

        dcp_cloud.remove_checkpoint(uri, config=self._store())
        left = targets.stored_keys(self.target, self.case_id, name)
        if left:
            self.report.mismatches.append(f"rm of {name} left {len(left)} object(s): {left[:5]}")

    # -- driver ---------------------------------------------------------------------------------------
    def phases(self) -> list[tuple[str, int, Any]]:
        c = self.case
        out: list[tuple[str, int, Any]] = [("stock save", c.w1, self.stock_save), ("stock load", c.w2, self.stock_load)]
        if self.stock_only:
            return out
        if self.incremental:
            out.append(("base save", c.w1, self.base_save))
        if self.overwrite:
            out.append(("earlier save", c.w1, self.earlier_save))
            if c.opt("reader_reuse"):
                out.append(("earlier load", c.w2, self.earlier_load))
        elif self.reuse_writer:
            out.append(("first save", c.w1, self.first_save))
        out += [
            ("save", c.w1, self.save),
            ("load", c.w2, self.load),
            ("download", 1, self.download),
            ("stock load of ours", c.w2, self.stock_load_ours),
        ]
        if self.incremental:
            out.append(("incremental bytes", 1, self.incremental_bytes))
        if self.overwrite:
            out.append(("leftovers", 1, self.leftovers))
        if c.opt("copy"):
            out += [("copy", 1, self.copy), ("load of the copy", c.w2, self.load_copy)]
        if self.overwrite and self.incremental:
            out += [("base overwrite", c.w1, self.base_overwrite), ("load after base overwrite", c.w2, self.load)]
        if c.opt("tier"):
            out += [
                ("tiered save", c.w1, lambda: fuzz_tiers.tiered_save(self)),
                ("lose a node", 1, lambda: fuzz_tiers.lose_node(self)),
                ("tiered load", c.w2, lambda: fuzz_tiers.tiered_load(self)),
            ]
        if c.opt("cleanup") == "gc":
            out += [("gc", 1, self.gc), ("load after gc", c.w2, self.after_gc)]
        elif c.opt("cleanup") == "rm":
            out.append(("rm", 1, self.rm))
        return out


def run_case(
    ranks: Any,
    case: Case,
    target: Target,
    case_id: str,
    workdir: str,
    stock_only: bool,
    notify: Callable[[str], None],
) -> RankReport:
    """Run every phase of ``case`` on this rank (all ranks of the world call this together), or only stock's
    save and load of it as drawn (``stock_only``); ``notify`` tells the launcher of this rank's error at once
    (should the other ranks then hang)."""
    if ranks.last_target != target.name:
        import dcp_cloud

        os.environ.update(target.env)
        dcp_cloud.close_clients()
        ranks.last_target = target.name
    run = CaseRun(ranks, case, target, case_id, workdir, stock_only)
    try:
        for name, width, fn in run.phases():
            error = ""
            started = time.perf_counter()
            if ranks.rank < width:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported with the case
                    lines = traceback.format_exc().splitlines()
                    text = "\n".join(lines[-_TRACE_LINES:])
                    error = f"--- rank {ranks.rank}, phase {name!r}: {type(exc).__name__}\n{text}"
                    notify(error)
            run.report.timings[name] = time.perf_counter() - started
            errors: list[str] = [""] * ranks.size
            dist.all_gather_object(errors, error)
            if any(errors):
                run.report.failed_phase = name
                run.report.error = "\n".join(e for e in errors if e)
                break
    finally:
        if ranks.rank == 0 and not os.environ.get("DCP_CLOUD_FUZZ_KEEP"):
            try:
                targets.remove(target, case_id)
            finally:
                shutil.rmtree(run.work, ignore_errors=True)
    return run.report
