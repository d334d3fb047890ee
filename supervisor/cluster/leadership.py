"""Who leads a multi-node run: terms claimed on the shared run directory, leases beaten there.

The run directory is the one thing every node already shares (the same path on every node,
docs/multinode.md) and the one thing that outlives any node. A store held by one node (torch's
``TCPStore``, the leader's own socket) dies with that node, which is exactly the failure this
module exists for; so the witness is the shared directory::

    RUN_DIR/leader/term-<E>.json   who leads term E: node rank, host, the address it listens
                                   on. Created once, with O_CREAT|O_EXCL: of two claimants,
                                   exactly one wins; the newest term is the one in force
    RUN_DIR/nodes/<R>/lease.json   node R's babysitter beating: a counter bumped every
                                   ``nodes.heartbeat_s`` (by its own thread), then ``gone`` once
                                   it has left the run

Failure model (what each babysitter concludes, and from what):

- **A babysitter that dies** (killed, its machine gone) stops beating. Another judges that by
  its own monotonic clock: the counter unchanged for ``nodes.lost_after_s``. Clocks are never
  compared across machines.
- **A follower that loses its leader** (connection closed, or silent) stops its ranks at once:
  they cannot train without the others. Then it reads the leader's lease. Beating: the leader
  lives and this node is cut off; it keeps trying to rejoin (a partition that heals), up to
  ``nodes.rejoin_timeout_s``. Stale: the leader is gone; it claims the next term. One claim
  wins; the others join the winner at the address its term file gives. When the leader's host
  refuses the connection (it answers, but nobody listens on the port: the babysitter died, the
  machine did not), a silence of ``2 x heartbeat_s + 1`` s is enough: a live babysitter's own
  thread beats every ``heartbeat_s`` and would also be listening.
- **A leader that sees a newer term** was given up by the others (cut off long enough for them
  to elect another): it is *fenced*. It stops its ranks, commands nobody, writes nothing more to
  the run's record and exits. It looks every second (every ``heartbeat_s`` if that is
  shorter) and before every launch. A leader that cannot beat its lease (the
  shared storage gone from under it) stops its ranks the same way: the others elect a new
  leader once its lease is stale, and it must not be training when they do.
- **A node rank 0 that starts** while another node leads a live term (the old leader coming
  back) follows that leader; it never takes the run back.

Assumptions: exclusive create is atomic on the shared storage (a local disk, NFSv3 and later,
Lustre, GPFS), and what one node writes is visible to the others within ``lost_after_s`` (on NFS
keep the attribute cache, ``actimeo``, below it). The leases are files written in place, so a
reader may see a torn write now and then: it counts as "no news", never as a beat.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LEADER_DIR = "leader"
TERM_GLOB = "term-*.json"


@dataclass(frozen=True, slots=True)
class Term:
    """One leader's term."""

    epoch: int
    node: int
    """The leading babysitter's node rank."""
    host: str
    address: str
    """``host:port`` where it listens for the other nodes."""
    pid: int

    def describe(self) -> str:
        return f"term {self.epoch}: node {self.node} ({self.host}) at {self.address}"


def term_path(run_dir: Path, epoch: int) -> Path:
    return run_dir / LEADER_DIR / f"term-{epoch:06d}.json"


def newest(run_dir: Path) -> Term | None:
    """The term in force (the highest epoch written whole), or None before the first."""
    folder = run_dir / LEADER_DIR
    for path in sorted(folder.glob(TERM_GLOB), reverse=True):
        term = _read_term(path)
        if term is not None:
            return term
    return None


def read(run_dir: Path, epoch: int) -> Term | None:
    """Term ``epoch``, or None if nobody claimed it (or it cannot be read)."""
    return _read_term(term_path(run_dir, epoch)) if epoch >= 0 else None


def claim(run_dir: Path, epoch: int, node: int, host: str, address: str) -> Term | None:
    """Claim term ``epoch`` for this babysitter; the term if this call won it, None if another
    claimant did (read ``newest`` for the winner)."""
    path = term_path(run_dir, epoch)
    path.parent.mkdir(parents=True, exist_ok=True)
    term = Term(epoch, node, host, address, os.getpid())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(term), f)
        f.flush()
        os.fsync(f.fileno())
    return term


def _read_term(path: Path) -> Term | None:
    """A term file, or None while its claimant is still writing it (or it is damaged)."""
    try:
        data = json.loads(path.read_text())
        return Term(int(data["epoch"]), int(data["node"]), str(data["host"]),
                    str(data["address"]), int(data["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- leases -------------------------------------------------------------------------------------


def lease_path(run_dir: Path, node: int) -> Path:
    return run_dir / "nodes" / str(node) / "lease.json"


class Lease:
    """This babysitter's own lease: beaten by a daemon thread, so a babysitter busy stopping
    workers or reading stacks still beats. ``last_ok`` says when a beat last reached the
    storage: a leader that cannot write it for ``lost_after_s`` must stop its ranks."""

    def __init__(self, run_dir: Path, node: int, host: str, every_s: float) -> None:
        self.path = lease_path(run_dir, node)
        self.node, self.host, self.every_s = node, host, every_s
        self.beat = 0
        self.last_ok = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> Lease:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write("alive")
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name=f"babysit-lease-{self.node}")
        self._thread.start()
        return self

    def leave(self) -> None:
        """Stop beating and say this babysitter is gone: whoever waits for it stops waiting."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 1.0)
        self._write("gone")

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            self._write("alive")

    def _write(self, state: str) -> None:
        with self._lock:
            self.beat += 1
            body = json.dumps({"node": self.node, "host": self.host, "pid": os.getpid(),
                               "beat": self.beat, "state": state})
            try:  # in place, padded: the same inode, so no reader caches a stale name
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    os.pwrite(fd, body.ljust(256).encode(), 0)
                finally:
                    os.close(fd)
            except OSError:
                return
            self.last_ok = time.monotonic()


class LeaseWatch:
    """Another babysitter's lease, as seen from here: ``alive`` while its counter moves,
    ``stale`` once it has not moved (or never was written) for ``lost_after_s`` of this
    machine's clock, ``gone`` when it said so. ``moved``: a beat was seen after the first."""

    def __init__(self, run_dir: Path, node: int, lost_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = lease_path(run_dir, node)
        self.node = node
        self.lost_after_s = lost_after_s
        self.clock = clock
        self._seen: tuple[int, int] | None = None
        self._since = clock()
        self.moved = False

    def state(self) -> str:
        now = self.clock()
        lease = _read_lease(self.path)
        if lease is not None and lease.get("state") == "gone":
            return "gone"
        mark = (int(lease.get("pid", 0)), int(lease.get("beat", 0))) if lease else None
        if mark is not None and mark != self._seen:
            self.moved = self.moved or self._seen is not None
            self._seen, self._since = mark, now
        if now - self._since <= self.lost_after_s:
            return "alive"
        return "stale"

    def silent_s(self) -> float:
        return self.clock() - self._since


def _read_lease(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_bytes().decode().strip())
        if isinstance(data, dict):
            return data
    return None


def wait_alive(watch: LeaseWatch, poll_s: float, stopping: Callable[[], bool]) -> bool:
    """Watch a lease until it beats (True) or goes stale or gone (False): a fresh watch needs
    up to ``lost_after_s`` to tell a dead babysitter's last beat from a live one's."""
    while not stopping():
        if watch.state() != "alive":
            return False
        if watch.moved:
            return True
        time.sleep(poll_s)
    return False
