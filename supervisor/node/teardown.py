"""After every rank closed its run, only the process teardown is left: did it crash, or hang?

Both are judged the same way in the end: the training finished, so the attempt counts as
finished, and the journal says what went wrong on the way out (``tick.NodeExit.teardown``).

    teardown_only(code, attempt_dir)   torchrun failed, but no rank left an error of its own
    Teardown(pids, now).stuck(now)     the ranks' processes have sat idle for ``idle_s``, or
                                       exited while torchrun lingers (``linger_s``: longer
                                       on several nodes, see ``Teardown``)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import psutil

from babysit.policies.detectors import CrashClass, classify
from babysit.supervisor.node import launcher, stall


def teardown_only(code: int, attempt_dir: Path) -> bool:
    """For an attempt whose every rank closed its run cleanly (``NodeWorkers.all_closed``): the
    ranks that failed left no error of their own (killed by a signal, no traceback), so the
    training finished and only the process teardown crashed (gloo in torch 2.13 sometimes
    aborts at exit with "terminate called without an active exception"). An exception raised
    after ``run.close()`` leaves a traceback and stays a crash."""
    logs = launcher.rank_logs(attempt_dir)
    classes = {classify(code, None, launcher.tail(path), None).crash_class
               for path in logs.values()}
    return classes <= {CrashClass.KILLED, CrashClass.UNKNOWN}


class Teardown:
    """After every rank of a node closed its run, is the process teardown stuck?

    torchrun exits once its ranks' processes do. A rank can hang in its teardown instead (gloo
    in torch 2.13 sometimes blocks in a peer's destructor after a peer node aborted), and then
    torchrun waits forever. ``stuck(now)`` each tick: True once the ranks' processes used less
    than ``IDLE_CPU`` of a core over ``idle_s`` seconds since the last look, which a script
    still working after ``run.close()`` (saving a model, an upload, an eval) does not.

    Or once every rank's process has exited, torchrun reaped them, and it is still up
    ``linger_s`` later (not reaped: ``idle_s``, as a torchrun too loaded to look is no wait): on
    several nodes its agent waits in its exit barrier for every other node's, and one whose
    rank aborted in gloo's teardown never comes (the barrier's own timeout is minutes). Nothing
    is left on this node to finish: ``exited`` says which way it was judged. On one node
    nobody else is waited for: ``EXITED_S``. On several, another node still tearing down is
    not one that never comes: its own babysitter gives its ranks ``idle_s`` before it stops
    them, so a follower waits that long more (``linger_s``); the node whose torchrun hosts the
    rendezvous store (the leader's) waits as long as any other node's torchrun runs
    (``stuck(now, others_up=True)``), since stopping it takes the store from under their exit
    barrier and shutdown (a traceback on every one of them), and ``EXITED_S`` after the last.
    A torchrun (``launcher``) still working then, running or using ``IDLE_CPU`` of a core, is
    not waiting on a barrier: it is shutting down on a loaded machine (it took over 3 s on CI's
    2 busy cores), and is looked at again ``linger_s`` later.
    """

    EXITED_S = 3.0
    """torchrun's own exit once its ranks are gone takes about 0.5 s (measured beside the
    goodput benchmark's calibration: 0.47 s); six times that is not an exit, it is a wait."""

    IDLE_CPU = 0.01
    """Cores used over the whole window (0.3 s of CPU over 30 s): a process blocked on a socket
    uses about 0; any work at all (TLS, serialization, a loop) uses more."""

    def __init__(self, pids: Mapping[int, int], now: float, idle_s: float = 30.0,
                 linger_s: float = EXITED_S, launcher: int | None = None) -> None:
        self.pids = dict(pids)
        self.launcher = launcher
        """torchrun's pid, if known: whether it still works once its ranks are gone."""
        self._launcher: stall.Sample | None = None
        self.idle_s = idle_s
        self.linger_s = linger_s
        self._since = now
        self._sample = stall.Sample(self.pids)
        self.seen: dict[int, stall.RankProcess] = {}
        """The processes as of the last look (the journal's evidence)."""
        self.exited = False
        """Judged stuck because every rank's process had exited and torchrun had not."""
        self._exited_at: float | None = None
        self._reaped_at: float | None = None

    def stuck(self, now: float, others_up: bool = False) -> bool:
        """``others_up``: other nodes' torchruns still run and need this one's (it hosts their
        rendezvous store): its lingering is waited out, and ``linger_s`` counts from the tick
        that says they are gone."""
        present = stall.statuses(self.pids.values())
        if all(s == psutil.STATUS_ZOMBIE for s in present):
            if others_up:
                self._exited_at = self._reaped_at = None
                return False
            self._exited_at = now if self._exited_at is None else self._exited_at
            # torchrun waits on its exit barrier only after it reaped its ranks: a zombie left
            # means it has not looked yet (a loaded machine), not that it waits for another node
            if present:
                waited, limit = now - self._exited_at, max(self.linger_s, self.idle_s)
            else:
                if self._reaped_at is None:
                    self._reaped_at, self._launcher = now, self._sample_launcher()
                waited, limit = now - self._reaped_at, self.linger_s
                if waited >= limit and self._launcher_works():
                    self._reaped_at, self._launcher = now, self._sample_launcher()
                    return False  # shutting down, slowly: looked at again linger_s later
            if waited >= limit:
                self.exited = True
                self.seen = stall.Sample(self.pids).finish(0.0)
                return True
            return False
        if now - self._since < self.idle_s:
            return False
        self.seen = self._sample.finish(0.0)
        if all(p.cpu < self.IDLE_CPU and p.state != "disk-sleep" for p in self.seen.values()):
            return True
        self._since, self._sample = now, stall.Sample(self.pids)  # working: look again later
        return False

    def _sample_launcher(self) -> stall.Sample | None:
        return None if self.launcher is None else stall.Sample({-1: self.launcher})

    def _launcher_works(self) -> bool:
        """torchrun ran, or used ``IDLE_CPU`` of a core, since the ranks were reaped (or the
        last look): a torchrun waiting on its exit barrier sleeps on a socket."""
        if self._launcher is None:
            return False
        seen = self._launcher.finish(0.0)[-1]
        return seen.state == psutil.STATUS_RUNNING or seen.cpu >= self.IDLE_CPU
