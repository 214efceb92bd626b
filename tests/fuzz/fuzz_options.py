"""The fuzzer's option space: ONE declarative table, and the stores a case can run against.

A new option of the writers, readers, transfer, staging or S3 configuration joins
the fuzzer the day it is added, with one line in :data:`OPTIONS`::

    Option("new_knob", "transfer", (DEFAULT, 0, 1 * MiB)),

``DEFAULT`` means "leave it out": the product's default is what most users run, so
it comes first and is where hypothesis shrinks to. Each case draws one value per
option, independently; ``"transfer"`` options are drawn twice (once for the save,
once for the load), since a checkpoint is usually read by another job than the one
that wrote it.

A new store is one more :class:`Target` (see ``tests/fuzz/conftest.py``, which builds
them from the session's servers): another S3 server (s3rver, Ceph RGW) is a ``kind="s3"``
target with its own endpoint, credentials and smallest multipart part; GCS (fake-gcs-server)
is the ``kind="gcs"`` target, Azure (Azurite) the ``kind="azure"`` one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KiB = 1024
MiB = 1024 * KiB


class _Default:
    """The product's default: the keyword is not passed at all."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
#: A ``part_size`` value: the target's smallest multipart part (256 KiB on the moto fixture, 1 byte on disk).
MIN_PART = "min_part"

#: Where an option goes: TransferConfig (save and load each draw their own), the writer's or reader's
#: keywords, StagingConfig, S3Config (S3 targets only), GCSConfig (GCS targets only), AzureConfig (Azure targets
#: only), or how the case calls DCP.
SCOPES = ("transfer", "writer", "reader", "staging", "s3", "gcs", "azure", "save", "load", "case")


@dataclass(frozen=True)
class Option:
    #: Keyword (or field) name, unique in the table.
    name: str
    #: One of :data:`SCOPES`.
    scope: str
    #: Values drawn from; the first is the shrink target (normally ``DEFAULT``).
    values: tuple[Any, ...]
    #: Target kinds it applies to (None: all).
    kinds: tuple[str, ...] | None = None
    #: Target names it applies to, within its kinds (None: every target of those kinds); an option a server
    #: cannot honour is not drawn there, so it neither wastes that store's cases nor shifts their draws.
    targets: tuple[str, ...] | None = None
    #: Chosen from a hash of the case's other draws instead of drawn: an option added for some stores then
    #: leaves the derandomized tiers' draws of those stores as they were (their layouts, their books). The
    #: long tier's random draws still vary it with every case.
    derived: bool = False


OPTIONS: tuple[Option, ...] = (
    # -- dcp_cloud.TransferConfig (drawn for the save and, separately, for the load) --------------------
    Option("reshard_gap", "transfer", (DEFAULT, 0, 16 * MiB)),
    Option("coalesce_gap", "transfer", (DEFAULT, 0, 1, 1 * MiB)),
    Option("coalesce_ratio", "transfer", (DEFAULT, 0.0, 16.0)),
    Option("read_chunk_size", "transfer", (DEFAULT, 4096, 12 * KiB)),
    Option("part_size", "transfer", (DEFAULT, MIN_PART)),
    Option("multipart_threshold", "transfer", (DEFAULT, 1)),
    Option("max_inflight_parts", "transfer", (DEFAULT, 1, 2)),
    Option("max_objects_per_rank", "transfer", (DEFAULT, 1, 3)),
    Option("concurrency", "transfer", (DEFAULT, 1, 3)),
    Option("checksum_block_size", "transfer", (DEFAULT, 4096)),
    Option("verify_checksums", "transfer", (DEFAULT, False)),
    Option("speculative_reads", "transfer", (DEFAULT, False)),
    #: A save setting (the load's draw changes nothing): tiles exist from chunks of 256 KiB (the "big" shapes).
    Option("column_tiles", "transfer", (DEFAULT, 2, 8)),
    # -- S3Writer / LocalWriter keywords ------------------------------------------------------------------
    Option("checksums", "writer", (DEFAULT, False)),
    Option("compression", "writer", (DEFAULT, "zstd")),
    Option("compression_level", "writer", (DEFAULT, 1)),
    Option("spread_prefixes", "writer", (DEFAULT, True)),
    # Of an incremental case, this is the *base* save's value (the incremental save passes base=).
    Option("hashes", "writer", (DEFAULT, True, False)),
    # -- S3Reader / LocalReader keywords ------------------------------------------------------------------
    Option("share_metadata", "reader", (DEFAULT, False)),
    Option("share_reads", "reader", (DEFAULT, False)),
    # -- dcp_cloud.StagingConfig (what dcp.async_save stages into) ----------------------------------------
    Option("pool", "staging", (DEFAULT, False)),
    Option("background", "staging", (DEFAULT, True)),
    Option("slab_bytes", "staging", (DEFAULT, 1 * MiB)),
    Option("pool_bytes", "staging", (DEFAULT, 0)),
    # The device ring: it engages for CUDA tensors only (these CPU cases check that it changes nothing else);
    # the reader gets the same StagingConfig as the writer.
    Option("ring_chunks", "staging", (DEFAULT, 0, 2)),
    Option("ring_chunk_bytes", "staging", (DEFAULT, 1 * MiB)),
    Option("pin_arenas", "staging", (DEFAULT, False)),
    Option("copy_threads", "staging", (DEFAULT, 1)),
    # -- S3Config ------------------------------------------------------------------------------------------
    Option("client", "s3", (DEFAULT, "botocore", "lean"), kinds=("s3",)),
    #: S3ObjectOptions on moto (fuzz_targets.s3_object_options; RGW has no KMS or extra storage classes here,
    #: so it is not drawn there): SSE-KMS (moto's default key, a Bucket Key), a storage class, tags.
    Option(
        "object_options",
        "s3",
        (DEFAULT, "sse_kms", "storage_class", "tags", "all"),
        kinds=("s3",),
        targets=("s3-moto",),
    ),
    # -- GCSConfig -----------------------------------------------------------------------------------------
    Option("transport_checksums", "gcs", (DEFAULT, False), kinds=("gcs",)),
    #: GCSConfig.object_options on fake-gcs-server (fuzz_targets.gcs_object_options): a storage class (kept by the
    #: emulator), requester pays, a customer key (allowed over the emulator's http), a KMS key, or three of them;
    #: the emulator accepts all of them, so every GCS target takes it. Named apart from S3's. Derived, not
    #: drawn: the GCS share of the CI tier keeps the layouts (and the discriminating incremental checks) it drew.
    Option(
        "gcs_object_options",
        "gcs",
        (DEFAULT, "storage_class", "user_project", "csek", "cmek", "all"),
        kinds=("gcs",),
        derived=True,
    ),
    # -- AzureConfig: its transport_checksums (DEFAULT on Azurite's http:// endpoint: a Content-MD5 on every
    # upload); named apart from GCS's, as names are unique in the table -----------------------------------------
    Option("azure_transport_checksums", "azure", (DEFAULT, False), kinds=("azure",)),
    #: AzureConfig.object_options (fuzz_targets.azure_object_options; Azure targets only), with what Azurite
    #: honours: an access tier and index tags it keeps, and an encryption scope it accepts (it refuses
    #: customer-provided keys; an archived blob cannot be read back). A copy "beside" copies with them: Copy
    #: Blob with the tier and tags, through the process with the scope ("all"). Derived, not drawn: the Azure
    #: share of the CI tier keeps the layouts (and the discriminating incremental checks) it drew before.
    Option("azure_object_options", "azure", (DEFAULT, "tier", "tags", "all"), kinds=("azure",), derived=True),
    # -- how the case calls DCP ----------------------------------------------------------------------------
    #: dcp.save, or dcp.async_save through the writer's staging pool.
    Option("async_save", "save", (False, True)),
    #: DCP's DefaultSavePlanner, or dcp_cloud.BalancedSavePlanner (default size, or small enough to split).
    Option("planner", "save", (DEFAULT, "balanced", "balanced_split")),
    #: dcp.load (DefaultLoadPlanner), or dcp_cloud.load (ScaleLoadPlanner).
    Option("api", "load", ("dcp", "dcp_cloud")),
    #: A load by one process of a group outside DCP's collectives (an evaluation job): with w2 == 1 only
    #: (ignored otherwise); its reader gets share_metadata=False and no group, as the reader's docs say.
    Option("no_dist", "load", (False, True)),
    #: Our load asks for a part of the state (every top-level key but the first, where there are two or more:
    #: the weights without the optimizer); with reader_reuse, the reader's second load is the whole state.
    Option("partial_load", "load", (False, True)),
    #: Save a base first (other values of the same items), then this case's state with base=.
    Option("incremental", "case", (False, True)),
    #: Save other values at the checkpoint first, then this case's state there with overwrite=True (its
    #: replaced objects must be gone); an incremental case then also overwrites its base, which must keep
    #: what the case's checkpoint still references.
    Option("overwrite", "case", (False, True)),
    #: Copy the saved checkpoint with copy_checkpoint (an incremental one standalone) beside it in the same
    #: store (server-side) or to a local directory (streamed from a bucket), verify both, and load the copy.
    Option("copy", "case", (False, "beside", "to_disk")),
    #: Load twice with one reader (torch calls reset() only with a checkpoint_id: the second load reuses it
    #: as it is, like a model and then an optimizer loaded from one checkpoint); an overwrite and incremental
    #: case loads with it once more after its base is overwritten.
    Option("reader_reuse", "case", (False, True)),
    #: Save other values first with the writer the case's save then reuses (a training loop's one writer):
    #: elsewhere, then at the case's URI through dcp.save's checkpoint_id; in an overwrite case at the same
    #: URI, without a checkpoint_id (no reset: the writer starts its next save by itself).
    Option("writer_reuse", "case", (False, True)),
    #: At the end: gc of the case's root (nothing a committed checkpoint references may go; the checkpoint,
    #: and its copy, load again), or rm: an incremental case's base is refused while the checkpoint uses it,
    #: then the checkpoint (and then its base) is removed, leaving no object behind.
    Option("cleanup", "case", (False, "gc", "rm")),
    #: After the case's load: the state saved as step 1 of a run through a CheckpointManager with a local tier
    #: (the ranks split into two simulated nodes, each its own directory), draining to the case's store every step
    #: (step 1 is drained) or every 2nd (it is not), and loaded back by a new manager on the load layout's ranks.
    Option("tier", "case", (False, "drain_every_1", "drain_every_2")),
    #: The tier's peer copies (1: each node's files on the other node too; 0 where the save has one node).
    Option("tier_replicas", "case", (0, 1)),
    #: Before the tiered load, the second node's local directory is removed (a node lost).
    Option("tier_lose_node", "case", (False, True)),
)

_NAMES = [o.name for o in OPTIONS]
assert len(_NAMES) == len(set(_NAMES)), "option names must be unique"
assert all(o.scope in SCOPES for o in OPTIONS), "unknown scope"


@dataclass(frozen=True)
class Target:
    """One store a case can save to and load from (picklable: it travels to the ranks).

    ``kind`` picks the writer/reader classes and the plain-SDK helpers the ranks use
    (``"s3"``: S3Writer/S3Reader and boto3; ``"gcs"``: GCSWriter/GCSReader and
    google-cloud-storage; ``"azure"``: AzureWriter/AzureReader and azure-storage-blob;
    ``"local"``: LocalWriter/LocalReader and the filesystem).
    ``root`` is the bucket (s3, gcs) or directory (local) the cases write under, each
    case under its own prefix.
    """

    name: str
    kind: str
    root: str
    #: S3, GCS or Azure endpoint (None: local).
    endpoint_url: str | None = None
    region: str = "us-east-1"
    #: Environment the ranks set before a case on this target (credentials of an S3 server).
    env: dict[str, str] = field(default_factory=dict)
    #: Smallest multipart part the store accepts (what ``part_size=MIN_PART`` means there).
    min_part_size: int = 1
    #: Largest part and most parts (S3's).
    max_part_size: int = 5 * 1024 * MiB
    max_parts: int = 10_000


#: The sets of stores a differential run draws its cases' stores from (``fuzz_targets``'s parameter):
#: S3 on moto and a local directory, S3 on Ceph's RADOS Gateway (a production S3 implementation), or
#: GCS on fake-gcs-server, or Azure on Azurite.
STORES = ("moto+local", "rgw", "gcs", "azure")


def applicable(option: Option, kind: str, target: str) -> bool:
    return (option.kinds is None or kind in option.kinds) and (option.targets is None or target in option.targets)


def by_scope(values: dict[str, Any], scope: str) -> dict[str, Any]:
    """The drawn values of one scope, without the DEFAULTs (keywords to pass)."""
    scoped = {o.name for o in OPTIONS if o.scope == scope}
    return {k: v for k, v in values.items() if k in scoped and not isinstance(v, _Default)}


def encode_value(value: Any) -> Any:
    """JSON form of an option value (DEFAULT becomes the string "DEFAULT")."""
    return "DEFAULT" if isinstance(value, _Default) else value


def decode_value(value: Any) -> Any:
    return DEFAULT if value == "DEFAULT" else value
