"""The run layer: the steps of one training run under a root (latest, resume, retention), above ``dcp/`` and
``maintenance/``; nothing below imports it.

:class:`CheckpointManager` is the one public class (with its options
:class:`RetentionPolicy` and :class:`StepNaming`, and :class:`PendingSave`).
Modules, one job each: ``naming`` (step names), ``catalog`` (one listing
classified: where "committed" is decided), ``stepinfo`` (a step's record),
``policy`` (which steps stay: pure), ``retention`` (passes that delete),
``leases`` (readers' leases), ``storage`` (the root's store and each step's
writer and reader), ``writer`` (the step's writer), ``group`` (collectives),
``saving`` (a save's data half and its errors), ``background`` (the save in
flight and the retention it starts), ``view`` (rank 0's committed steps),
``report`` (``describe``), ``manager`` (the public class), and ``tiers/`` (a node-local tier, peer replicas
and the drain to the root: :class:`LocalTier`).
"""

from .manager import CheckpointManager
from .naming import StepNaming
from .pending import PendingSave
from .policy import RetentionPolicy
from .tiers.config import LocalTier
from .tiers.worker import TierStats

__all__ = ["CheckpointManager", "LocalTier", "PendingSave", "RetentionPolicy", "StepNaming", "TierStats"]
