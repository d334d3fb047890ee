"""The warm standby: the next attempt's workers, started while this one trains, held in
``attach()`` until a relaunch promotes them.

A cold relaunch pays for a new torchrun, its rendezvous, the interpreters, ``import torch`` and
the user's imports, ``init_process_group`` and the model build before the first step; the
checkpoint load and the step itself are the only parts that need the new attempt's facts. So
once attempt N has made its first step (its own start-up no longer competes for the CPU) and
trained ``AFTER_S`` seconds, babysit starts attempt N+1's torchrun with a rendezvous of its own
and ``BABYSIT_STANDBY`` set. Each of its ranks runs the script up to ``attach()``, which says
it is ready (a file per rank) and waits there, before it reads the directive or connects to
the telemetry socket, so it sends nothing and judges nothing. The states::

    off        launch.warm_standby is false, the run is multi-node, its rendezvous endpoint
               is fixed, or its script never attached (stdout mode): every relaunch is cold
    starting   torchrun and the ranks are up to attach() (up to the script: ``imports``); no
               rank said ready yet
    ready      every rank waits in attach() (``Standby.ready_at``), or before the script
    promoted   the relaunch wrote the attempt's directive, then the ``go`` file: the ranks
               read it and go on exactly as a fresh attempt's do; it is the attempt now. Only
               with every process of it alive (``Standby.lost``): one whose rank was killed
               while it waited (the OOM killer, a person) is stopped instead, journaled, and
               the relaunch is cold; promoted, it would fail at once on a rank that trained
               nothing (torchrun notices a dead rank only at its next look)
    exited     it ended on its own (an import error, say): journaled, never used, never the
               running attempt's crash; the next relaunch is cold and shows the error
    stopped    every rank of the running attempt closed its run (no attempt follows: killed
               at once, beside the ranks' exit), the run ended, or babysit stops: its whole
               process tree goes too

Two kinds (``kind``). ``full`` is the above. ``imports`` (``auto``'s choice where the job sees
NVIDIA GPUs) starts the same torchrun and rendezvous, but its ranks run ``rank/prewarm.py``:
import torch, say ready, wait for ``go`` and only then run the script. A relaunch through it
still pays the script's own start and the checkpoint load, but holds no CUDA context and runs
nothing of the script twice.

The cost of a full standby: a second torchrun and set of rank processes with torch imported
and whatever the script built before ``attach()`` (on a GPU, their CUDA contexts and any model
already on the device: 1.2 GB for 2 small ranks on an H200, docs/gpu.md); for 2 CPU ranks
of ``tests/workers/tiny_train.py``, about 0.8 GB resident (0.57 GB unique) and about 6
CPU-seconds to get ready (docs/recovery.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from babysit.supervisor.config.schema import LaunchConfig
from babysit.supervisor.contract import protocol
from babysit.supervisor.node.launcher import WorkerGroup
from babysit.supervisor.node.printed import rank_pids

FOLDER = "standby"
"""Inside the standby's attempt folder: ``ready/<local rank>`` per waiting rank, then ``go``."""
GO = protocol.STANDBY_GO
READY = protocol.STANDBY_READY


CONFIGURED_OFF = "launch.warm_standby is false"

Kind = Literal["full", "imports"]
"""Where a standby's ranks wait: in ``attach()`` (the script's start done) or before the script
(torch imported: ``rank/prewarm.py``)."""


def kind(launch: LaunchConfig, gpus: bool) -> Kind:
    """The standby this run gets when ``off_reason`` is None: ``imports`` when asked for, or
    with ``auto`` where the job can see NVIDIA GPUs (a full standby there holds a CUDA context
    and whatever the script put on the device, beside the training attempt); else ``full``."""
    if launch.warm_standby == "imports" or (launch.warm_standby == "auto" and gpus):
        return "imports"
    return "full"


def off_reason(launch: LaunchConfig, gpus: bool) -> str | None:
    """Why this run's relaunches are cold whatever happens, or None when a standby may run.
    ``gpus``: the job can see NVIDIA GPUs (``gpus_visible``). Pure."""
    if launch.warm_standby is False:
        return CONFIGURED_OFF
    if kind(launch, gpus) == "imports" and launch.no_python:
        return ("launch.no_python is set: an import standby runs the script with Python, after "
                "importing torch; set launch.warm_standby to true (it waits in attach()) or "
                "false")
    if launch.multinode:
        return "multi-node runs relaunch cold: a standby would need a rendezvous across nodes"
    if launch.rdzv_endpoint is not None or launch.master_port is not None:
        return ("the rendezvous endpoint is fixed (launch.rdzv_endpoint or master_port): a "
                "standby needs one of its own while the attempt holds it")
    return None


def gpus_visible(launch: LaunchConfig, environ: Mapping[str, str] = os.environ,
                 driver: Path = Path("/proc/driver/nvidia/gpus")) -> bool:
    """This machine has NVIDIA GPUs (the driver lists one) and the job's
    ``CUDA_VISIBLE_DEVICES`` (``launch.env``, else babysit's own environment) does not hide
    them all."""
    visible = launch.env.get("CUDA_VISIBLE_DEVICES", environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return any(driver.iterdir())
    except OSError:
        return False


STOP_GRACE_S = 2.0
"""SIGTERM -> SIGKILL for a standby: it trained nothing and has nothing to save, and a script's
own SIGTERM handler (for preemption) would otherwise keep its waiting ranks up for the whole
``launch.stop_grace_s`` while babysit waits."""
AFTER_S = 5.0
"""Seconds after the attempt's first step before its standby starts: an attempt that ends
sooner (a smoke test, a script that crashes at once every time) would pay the standby's
start-up, several CPU-seconds, for nothing; a long run loses nothing by waiting."""


WARMING_MAX_S = 60.0
"""How long at most a standby's start-up counts as babysit's own load on the machine (steps are
then not judged for throughput): a script that blocks before ``attach()`` must not blind the
throughput detector for the rest of the attempt."""


class Trigger:
    """When to start a standby, and for which attempt. Pure: told what happened, never acts.

    A standby starts once the running attempt has attached (a rank's hello: a script that never
    attaches would not wait, it would train a second time) and made its first step ``after_s``
    seconds ago (so its own start-up does not compete with the standby's), at most once per
    attempt: one that exited on its own is not started again for the same attempt.

    Or sooner, at a stall: once a stall is half-way to a hang suspicion (``looming``), a
    relaunch may be a second away, and the attempt's ranks are idle. With ``at_stall`` (the
    machine has a core per rank: ``spare_cores``) the standby starts then, so a hang in the
    first seconds of an attempt is not relaunched fully cold. Where the ranks outnumber the
    cores its start-up would take the CPU the hang's confirmation needs (at 24 ranks on 2
    cores, 40 s instead of 3), so it waits for ``after_s`` as before.

    Or at once, for an attempt that will likely be short (``new_attempt(..., soon=True)``): a
    rerun of a spike's steps (``policies.rerun``) ends in a second relaunch, the skip, as soon as
    it reproduces, which is often before ``after_s``; without a standby that relaunch was cold
    (4.7 s here against 0.3 s warm). Such a standby starts as the rerun is launched, not at its
    first step: a rerun of 18 steps reproduced 1.4 s after its launch, before a standby started
    at its first step (0.4 s in) was ready, and the skip waited for the rest. The script is
    known to attach (a rank of this run said hello: ``attached_before``). The same
    ``at_stall`` rule about cores applies.
    """

    def __init__(self, off: str | None, after_s: float = AFTER_S,
                 at_stall: bool = False) -> None:
        self.off = off
        self.after_s = after_s
        self.at_stall = at_stall
        self.attempt = -1
        self._attached = False
        self._first_step: float | None = None
        self._tried: set[int] = set()
        self._soon = False
        self._closed = False
        self.attached_before = False
        """Some attempt of this run attached: the script waits in ``attach()``."""

    def new_attempt(self, attempt: int, soon: bool = False) -> None:
        """``soon``: this attempt is likely to end in a relaunch within seconds (a rerun)."""
        self.attempt, self._attached, self._first_step = attempt, False, None
        self._soon = soon
        self._closed = False

    def observe(self, now: float, *, hello: bool, stepped: bool, closed: bool = False) -> None:
        """What this tick saw of the running attempt (``now``: monotonic seconds); ``closed``:
        every rank has closed its run, so no attempt follows (a standby started now would only
        take CPU from the ranks' exit)."""
        self._attached = self._attached or hello
        self.attached_before = self.attached_before or hello
        self._closed = self._closed or closed
        if stepped and self._first_step is None:
            self._first_step = now

    def due(self, now: float, running: bool, have: int | None,
            looming: bool = False) -> int | None:
        """The attempt to start a standby for now, or None. ``running``: the attempt runs and
        the loop watches it; ``have``: the attempt the standby already there is for;
        ``looming``: a stall is half-way to a hang suspicion."""
        target = self.attempt + 1
        at_once = self._soon and self.at_stall and self.attached_before
        waited = at_once or (self._first_step is not None and (
            now - self._first_step >= self.after_s or (looming and self.at_stall)))
        if (self.off is not None or not running or self.attempt < 0 or self._closed
                or not (self._attached or at_once) or not waited or have == target
                or target in self._tried):
            return None
        self._tried.add(target)
        return target


def spare_cores(ranks: int, cores: int | None = None) -> bool:
    """This machine has a core for every rank of the job (``Trigger.at_stall``)."""
    return ranks <= (cores if cores is not None else os.cpu_count() or 1)


@dataclass
class Standby:
    """One attempt's workers started ahead, not yet promoted."""

    attempt: int
    group: WorkerGroup
    folder: Path
    """``attempts/<attempt>/standby``: the ranks' ready files and the go file."""
    rdzv_endpoint: str
    kind: Kind = "full"
    started: float = field(default_factory=time.time)
    """Wall time torchrun was started."""
    paused: bool = False
    """Its processes are stopped (``NodeWorkers.hold_standby``): a hang is being confirmed."""
    at_stall: bool = False
    """Started at a stall (``Trigger.at_stall``): it is never paused for that stall's
    confirmation, which it was started to be ready for."""
    _ready: float | None = None

    def ready_at(self) -> float | None:
        """Wall time the last of its ranks said it waits in ``attach()``, once all did."""
        if self._ready is None:
            self._ready = self._read_ready()
        return self._ready

    def _read_ready(self) -> float | None:
        said = self._said()
        times = [float(s["time"]) for s in said.values()]
        world = next((int(s["world_size"]) for s in said.values()), None)
        return max(times) if world is not None and len(times) >= world else None

    def _said(self) -> dict[int, dict[str, Any]]:
        """Local rank -> what its ready file says (``world_size``, ``time``, ``pid``), for each
        rank that said it waits."""
        said = {}
        for path in (self.folder / READY).glob("*"):
            if not path.name.isdigit():  # a rank's file half-written
                continue
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                told = json.loads(path.read_text())
                said[int(path.name)] = {"world_size": int(told["world_size"]),
                                        "time": float(told["time"]), "pid": told.get("pid")}
        return said

    def lost(self, ranks: int | None = None) -> str | None:
        """Why it cannot become the attempt, or None when every process of it is alive:
        torchrun exited, or a rank's process is gone (a zombie torchrun has not reaped counts as
        gone). ``ranks``: how many ranks it starts, when known; the ready files say it too.
        A rank that torchrun has not started yet is not missing while none has started."""
        code = self.group.poll()
        if code is not None:
            return f"it exited on its own (exit code {code})"
        alive = rank_pids(self.group.processes())  # local rank -> pid, zombies left out
        said = self._said()
        for local, told in sorted(said.items()):
            if told["pid"] is not None and alive.get(local) != told["pid"]:
                return f"its rank {local}'s process (pid {told['pid']}) is gone"
        ranks = next((s["world_size"] for s in said.values()), ranks)
        missing = [r for r in range(ranks or 0) if r not in alive]
        if alive and missing:
            return f"the process of its rank {missing[0]} is gone"
        return None

    def warming(self, now: float) -> bool:
        """Still starting at wall time ``now`` (its ranks not all in ``attach()``), for at most
        ``WARMING_MAX_S``: its start-up competes with the training ranks for the CPU."""
        return now - self.started < WARMING_MAX_S and self.ready_at() is None

    def promote(self) -> None:
        """Let its ranks go on. Call after the attempt's directive is written."""
        tmp = self.folder / (GO + ".tmp")
        tmp.write_text(str(time.time()))
        os.replace(tmp, self.folder / GO)

    def launch_fields(self, now: float) -> dict[str, Any]:
        """The ``launch`` entry's fields of a promotion: seconds since the standby started, and
        how long every rank had been waiting (None: some were still starting; they go on as
        soon as they reach ``attach()``)."""
        ready = self.ready_at()
        return {"standby": True, "standby_kind": self.kind, "rdzv_endpoint": self.rdzv_endpoint,
                "standby_age_s": round(now - self.started, 3),
                "standby_ready_s": None if ready is None else round(max(0.0, now - ready), 3)}


def set_aside(attempt_dir: Path) -> None:
    """Before a cold start in ``attempt_dir``: move the logs of a standby that ran there and was
    never promoted (it exited on its own, or a supervisor died and the next one takes over)
    into its own folder, so no rank's log tail of the attempt is the standby's."""
    folder = attempt_dir / FOLDER
    if not folder.is_dir():
        return
    for name in ("torchrun", "launcher.log"):
        with contextlib.suppress(OSError):
            (attempt_dir / name).rename(folder / name)


def environment(folder: Path) -> dict[str, str]:
    """What a standby's ranks find in their environment (``rank.api`` reads it)."""
    return {protocol.ENV_STANDBY: str(folder), protocol.ENV_SUPERVISOR_PID: str(os.getpid())}
