"""Process plumbing the test servers share: a free port, dying with the parent, and stopping children."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Sequence

from .moto_server import _death_signal_setter, _free_port


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each of ``procs`` still running (last started first), wait up to ``grace`` seconds for all of
    them together, then SIGKILL and reap what is left. Only these PIDs are signalled."""
    for proc in reversed(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


__all__ = ["_death_signal_setter", "_free_port", "stop_processes"]
