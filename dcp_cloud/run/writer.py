"""The writer of one step of a run: a CloudWriter that puts the step's record right before its commit.

In ``finish`` (the coordinator's last step, inside torch's collective
wrapper, so a failure reaches every rank) it writes ``.step.json`` (see
:mod:`.stepinfo`): the user's metadata and the tokens of the objects the step
holds and references, known exactly there from the write results. Then it
commits as every CloudWriter does (``.metadata`` last, create-only). The
record is written create-only too: a record already there belongs to a save
that never committed (it is replaced) or to one another job committed (the
save is refused with StepExistsError).
"""

from __future__ import annotations

import os
import time
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ..dcp.save.writer import CloudWriter
from ..errors import CheckpointExistsError, ObjectNotFoundError, PreconditionFailedError, StepExistsError
from ..format.createonly import put_create_only
from ..format.layout import METADATA_NAME, STEP_INFO_NAME
from ..locations import Backend
from ..store.clients import environment_digest
from .steps.stepinfo import StepRecord, objects_of


class StepWriter(CloudWriter):
    """A CloudWriter for ``<root>/<step name>`` that writes the step's record before committing.

    ``record``: the record's fields known before the save (``step``, ``metadata``, ``base``, ``retention``);
    the objects and the world size are filled in from the save's results.
    """

    #: A step references unchanged items of its base only where this rank's unchanged items hold at least a
    #: quarter of the base object they are in, and 1 MiB: a reference keeps the base step whole for as long as
    #: a kept step needs it, which is worth it for frozen layers and a base model under adapters, not for a few
    #: unchanged bytes (an optimizer's pickled param groups) in a step of gigabytes.
    _reference_min_fraction = 0.25
    _reference_min_bytes = 1 << 20

    def __init__(
        self, checkpoint_id: str | os.PathLike[str], backend: Backend, *, record: dict[str, Any], **kwargs: Any
    ) -> None:
        self.record_fields = dict(record)
        #: The record this writer committed (the coordinator's, once ``finish`` returned).
        self.written: StepRecord | None = None
        super().__init__(checkpoint_id, backend, **kwargs)

    def fail_at_setup(self, error: BaseException) -> None:
        """Make this rank's first step of the save raise ``error`` (a staging failure): torch hands it to every
        rank there, so none waits in the save's collectives for a rank that cannot take part."""
        self._begin_error = error

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        name = self.uri.prefix.rpartition("/")[2]
        paths = [wr.storage_data.relative_path for rank in results for wr in rank]
        fields = self.record_fields
        record = StepRecord(
            step=int(fields["step"]),
            metadata=fields.get("metadata") or {},
            objects=objects_of(paths, name),
            saved_at=time.time(),
            world_size=len(results),
            base=fields.get("base"),
            retention=fields.get("retention"),
        )
        self._put_record(record.encode())
        try:
            super().finish(metadata, results)
        except CheckpointExistsError as exc:
            raise StepExistsError(
                f"step {record.step} of {self.checkpoint_id.rpartition('/')[0]} was committed by another job while "
                "this save ran (two jobs are saving to one run): nothing of this save is referenced. Stop the other "
                "job, or give each job its own root",
                record.step,
            ) from exc
        self.written = record

    def _put_record(self, body: bytes) -> None:
        store = self._retrying()
        key = self.uri.key(STEP_INFO_NAME)
        if self.overwrite:
            store.put(key, body)
            return
        try:
            put_create_only(store, key, body, (self.backend, self.uri.bucket, environment_digest()))
        except PreconditionFailedError:
            try:
                store.head(self.uri.key(METADATA_NAME))
            except ObjectNotFoundError:
                store.put(key, body)  # the record of a save that never committed: this save replaces it
                return
            step = int(self.record_fields["step"])
            raise StepExistsError(
                f"step {step} is already committed at {self.checkpoint_id} (another job saved it while this save "
                "ran); nothing of this save is referenced. Stop the other job, or give each job its own root",
                step,
            ) from None


__all__ = ["StepWriter"]
