"""Named points of the tiers' work where a crash-safety test can kill the process (nothing happens otherwise).

A test sets ``DCP_CLOUD_CRASH_AT=<point>`` (or ``<point>@<rank>``) in a spawned job; when that job's process
(of that group rank) reaches the point, it is killed with SIGKILL, as a node dies: nothing after it runs.
The store requests of the drain are killed at with :mod:`dcp_cloud.testing.tripwire` instead.
"""

from __future__ import annotations

import os
import signal

#: Where the tiers' work can be killed: between the local commit and the copy of its control files to the
#: other nodes; in the middle of the copy to peers; between the drain's uploads and its commit; between the
#: drain's commit and the nodes' marks; and while the local retention deletes.
POINTS = ("shared", "replicating", "drain-commit", "drain-marked", "retain-delete")


def reached(point: str, rank: int) -> None:
    """Kill this process if a test asked for ``point`` (on ``rank``)."""
    wanted = os.environ.get("DCP_CLOUD_CRASH_AT")
    if not wanted:
        return
    name, _, at = wanted.partition("@")
    if name == point and (not at or int(at) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["POINTS", "reached"]
