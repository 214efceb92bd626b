"""A throwaway one-node Ceph cluster with a RADOS Gateway (RGW), for tests against a production S3 server.

``CephRGW`` starts, in a fresh temporary directory, one ``ceph-mon``, one
``ceph-osd`` on the in-memory ``memstore`` backend (nothing touches a disk
but the monitor's small store), and ``radosgw`` with the beast frontend on a
free port of ``127.0.0.1``; no ``ceph-mgr``, cephx off. It then creates an
S3 user with fixed keys. Start to first answer takes about 2 s.

Every daemon runs in the foreground as a direct child (``-f``), in its own
session, with ``PR_SET_PDEATHSIG`` so the kernel kills it if the starting
process dies; :meth:`CephRGW.stop` (also the ``with`` block and ``atexit``)
signals exactly the PIDs it started, waits, and removes the directory.

The packages (Debian/Ubuntu: ``apt-get install -y --no-install-recommends
ceph-mon ceph-osd radosgw ceph-common``) are not Python dependencies;
:func:`missing_programs` says what is absent so a fixture can skip.

Two settings matter: ``ms mon client mode = crc`` (radosgw otherwise waits
for cephx and gives up after ``client mount timeout``) and ``paxos propose
interval = 0.1`` (otherwise every pool RGW creates lazily costs a second).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref

from ._procs import _death_signal_setter, _free_port, stop_processes

#: What must be on PATH to start a cluster.
PROGRAMS = ("monmaptool", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")
#: How to install them on Debian/Ubuntu.
INSTALL_HINT = "apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common"
ACCESS_KEY = "dcpcloudrgwkey"
SECRET_KEY = "dcpcloudrgwsecret"  # a throwaway user of a throwaway cluster on 127.0.0.1
#: The region any SigV4 signature may name: RGW's default zonegroup accepts it.
REGION = "us-east-1"
#: Smallest multipart part this cluster accepts (RGW's own default is 5 MiB).
MIN_PART_SIZE = 256 * 1024

_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_live: weakref.WeakSet[CephRGW] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for cluster in list(_live):
        with contextlib.suppress(Exception):
            cluster.stop()


class CephRGWError(RuntimeError):
    """The cluster could not be started."""


def missing_programs() -> list[str]:
    """The programs of :data:`PROGRAMS` that are not on PATH (empty when a cluster can start)."""
    return [p for p in PROGRAMS if shutil.which(p) is None]


_DIR_PREFIX = "dcp-cloud-rgw-"


def _remove_stale_dirs() -> None:
    """Remove the directories of clusters whose starting process is gone (killed before it could clean up:
    the kernel stopped their daemons, but about 40 MB of monitor store and logs stayed)."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        pid = name[len(_DIR_PREFIX) :].partition("-")[0]
        if not name.startswith(_DIR_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except PermissionError:
            continue  # alive, someone else's


def version() -> str:
    """The installed radosgw's version, e.g. ``"16.2.15"`` (``"?"`` if it cannot tell)."""
    try:
        out = subprocess.run(["radosgw", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    words = out.split()
    return words[2] if len(words) > 2 and words[:2] == ["ceph", "version"] else "?"


def _conf(root: str, fsid: str, mon_port: int, rgw_port: int, memstore_bytes: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_port}]
mon initial members = a
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
run dir = {root}/run
log file = {root}/log/$name.log
pid file = {root}/run/$name.pid
admin socket = {root}/run/$name.asok
keyring = /dev/null
crash dir = {root}/crash
client mount timeout = 30
[mon]
mon data = {root}/mon-$id
paxos propose interval = 0.1
[osd]
osd data = {root}/osd-$id
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
[client.rgw.gw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {root}/rgw
rgw multipart min part size = {MIN_PART_SIZE}
"""


class CephRGW:
    """A running one-node Ceph cluster with an S3 gateway on ``127.0.0.1`` (see the module docstring).

    ``endpoint_url``, :data:`ACCESS_KEY`, :data:`SECRET_KEY` and :data:`REGION` reach it; use path-style
    addressing (the endpoint is an IP address, so both S3 clients choose it by themselves). Start it
    from a thread that lives as long as it should (the main thread): the kernel stops the daemons when
    that thread exits.
    """

    access_key = ACCESS_KEY
    secret_key = SECRET_KEY
    region = REGION

    def __init__(self, *, memstore_bytes: int = 2 * 1024**3, startup_timeout: float = 60.0) -> None:
        self.memstore_bytes = memstore_bytes
        self.startup_timeout = startup_timeout
        self.root: str | None = None
        self.port: int | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise CephRGWError("the RGW cluster is not running; call start() or use it in a with block")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pids(self) -> list[int]:
        """PIDs of the daemons this object started and has not stopped."""
        return [p.pid for p in self._procs]

    def __repr__(self) -> str:
        return f"CephRGW(endpoint_url={self.endpoint_url!r}, pids={self.pids})" if self.port else "CephRGW(stopped)"

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> CephRGW:
        """Create and start the cluster and its S3 user; returns ``self``. Raises CephRGWError."""
        with self._lock:
            if self._procs:
                return self
            missing = missing_programs()
            if missing:
                raise CephRGWError(f"Ceph is not installed (missing {', '.join(missing)}): {INSTALL_HINT}")
            _live.add(self)
            try:
                self._start()
            except BaseException:
                self._stop()
                raise
            return self

    def _start(self) -> None:
        _remove_stale_dirs()
        self.root = root = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        for sub in ("run", "log", "rgw", "crash", "mon-a"):
            os.makedirs(os.path.join(root, sub))
        fsid = str(uuid.uuid4())
        mon_port, self.port = _free_port("127.0.0.1"), _free_port("127.0.0.1")
        conf = os.path.join(root, "ceph.conf")
        with open(conf, "w") as fh:
            fh.write(_conf(root, fsid, mon_port, self.port, self.memstore_bytes))
        deadline = time.monotonic() + self.startup_timeout
        monmap = os.path.join(root, "monmap")
        self._run(["monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", monmap])
        self._run(["ceph-mon", "-c", conf, "--mkfs", "-i", "a", "--monmap", monmap])
        self._daemon(["ceph-mon", "-c", conf, "-f", "-i", "a"])
        osd_uuid = str(uuid.uuid4())
        osd_id = self._run(["ceph", "-c", conf, "--connect-timeout", "20", "osd", "new", osd_uuid]).strip()
        if not osd_id.isdigit():
            raise CephRGWError(f"`ceph osd new` answered {osd_id!r}, not an OSD id")
        os.makedirs(os.path.join(root, f"osd-{osd_id}"))
        self._run(["ceph-osd", "-c", conf, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid])
        self._daemon(["ceph-osd", "-c", conf, "-f", "-i", osd_id])
        self._daemon(["radosgw", "-c", conf, "-f", "-n", "client.rgw.gw"])
        self._wait_for_gateway(deadline)
        self._run(
            ["radosgw-admin", "-c", conf, "user", "create", "--uid=dcp-cloud", "--display-name=dcp-cloud",
             f"--access-key={ACCESS_KEY}", f"--secret-key={SECRET_KEY}"]
        )  # fmt: skip

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("CEPH_ARGS", None)
        env["CEPH_CONF"] = os.path.join(self.root or "", "ceph.conf")
        return env

    def _run(self, cmd: list[str], timeout: float = 30.0) -> str:
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=self._env(), stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as exc:
            raise CephRGWError(f"`{cmd[0]}` did not finish within {timeout:.0f} s{self._logs()}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout)[-2000:]
            raise CephRGWError(f"`{' '.join(cmd[:3])}` failed with status {done.returncode}: {tail}{self._logs()}")
        return done.stdout

    def _daemon(self, cmd: list[str]) -> None:
        name = os.path.join(self.root or "", "log", f"{cmd[0]}.out")
        with open(name, "ab") as out:
            self._procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self._env(),
                    start_new_session=True,
                    preexec_fn=_death_signal_setter(os.getpid()),
                    close_fds=True,
                )
            )

    def _wait_for_gateway(self, deadline: float) -> None:
        while True:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise CephRGWError(f"{proc.args[0]} exited with status {proc.returncode}{self._logs()}")
            try:
                with _direct.open(f"{self.endpoint_url}/", timeout=2) as resp:
                    if resp.status < 500:
                        return
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise CephRGWError(f"RGW did not answer within {self.startup_timeout:.0f} s{self._logs()}")
            time.sleep(0.05)

    def _logs(self, limit: int = 1500) -> str:
        """The ends of the daemons' logs, for an error message."""
        if not self.root:
            return ""
        parts = []
        log_dir = os.path.join(self.root, "log")
        for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else ():
            with contextlib.suppress(OSError), open(os.path.join(log_dir, name), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - limit))
                parts.append(f"--- {name}:\n{fh.read().decode('utf-8', 'replace')}")
        return ("\n" + "\n".join(parts)) if parts else ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every daemon it started (radosgw last to go: about 5 s), SIGKILL what is left after
        ``grace`` seconds, and remove the directory. Safe to call twice."""
        with self._lock:
            self._stop(grace)

    def _stop(self, grace: float = 10.0) -> None:
        procs, self._procs = self._procs, []
        stop_processes(procs, grace)
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root, self.port = None, None
        _live.discard(self)

    def __enter__(self) -> CephRGW:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


__all__ = [
    "ACCESS_KEY",
    "INSTALL_HINT",
    "REGION",
    "SECRET_KEY",
    "CephRGW",
    "CephRGWError",
    "missing_programs",
    "version",
]
