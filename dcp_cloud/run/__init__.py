"""The run layer: the steps of one training run under a root (latest, resume, retention), above ``dcp/`` and
``maintenance/``; nothing below imports it.

:class:`CheckpointManager` is the one public class (with its options
:class:`RetentionPolicy` and :class:`StepNaming`, and :class:`PendingSave`).
``manager`` (the public class, a facade) composes ``strategy`` (where steps go: the root, or a local tier),
``saves`` (a step's save: agreed, written, committed; ``saving``: its data half and its errors),
``loading`` (a load from the root), ``background`` (the save in flight and the retention it starts),
``storage`` (the root's store and each step's writer and reader), ``writer`` (a step's writer: its record
before its commit), ``group`` (collectives) and ``pending`` (a save's handle), over three packages:
``steps/`` (step names, one listing classified: where "committed" is decided, each step's record, rank 0's
view, ``describe``), ``retention/`` (which steps stay: pure rules, the passes that delete, readers' leases)
and ``tiers/`` (a node-local tier, peer replicas and the drain to the root: :class:`LocalTier`).
"""

from .manager import CheckpointManager
from .pending import PendingSave
from .retention.policy import RetentionPolicy
from .steps.naming import StepNaming
from .tiers.config import LocalTier
from .tiers.worker import TierStats

__all__ = ["CheckpointManager", "LocalTier", "PendingSave", "RetentionPolicy", "StepNaming", "TierStats"]
