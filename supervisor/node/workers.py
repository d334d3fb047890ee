"""This node's workers: the telemetry socket, one torchrun per attempt, and its ranks.

The supervisor of a single-node run and every node's babysitter of a multi-node run do the same
things with their own node's processes: open the socket the ranks report to, write the
attempt's directive and start its control file, start torchrun with the environment the worker
API reads, learn each rank's pid from its hello, notice torchrun's exit (and whether only its
teardown crashed), stop the whole process tree, and pass the ranks' output on to the console.
That lives here, once; what to *do* about what the workers do is the caller's business.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from babysit.checkpoints.memory import on_node
from babysit.policies.types import RankStep, Remedy
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract import protocol
from babysit.supervisor.contract.control import ControlFile
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.node import (
    ahead,
    flight_recorder,
    last_step,
    launcher,
    reports,
    shield,
    shm,
    standby,
    teardown,
)
from babysit.supervisor.node.intake import Intake
from babysit.supervisor.node.printed import SOURCE, Entry, PrintedProgress, rank_pids


class NodeWorkers:
    """Starts, watches and stops the attempts of one node. ``open()`` binds the socket."""

    def __init__(self, plan: RunPlan, run_dir: Path, early: ahead.Early | None = None) -> None:
        """``early``: the first attempt's torchrun, started by ``babysit run`` before it read
        the config: the first launch takes it where it fits (``ahead.Early.unfit``)."""
        self.plan = plan
        self.run_dir = run_dir
        self.token = secrets.token_bytes(protocol.TOKEN_BYTES)
        self.intake = Intake(run_dir / "telemetry.sock", self.token)
        self.lines: queue.Queue[launcher.OutputLine] = queue.Queue(maxsize=10_000)
        self.group: launcher.WorkerGroup | None = None
        self.rank_pids: dict[int, int] = {}
        """Global rank -> pid, from each rank's hello in this attempt."""
        self.closed_ranks: set[int] = set()
        self.control = ControlFile()
        """Requests to the running ranks (checkpoint cadence, a final checkpoint)."""
        self.global_rank: dict[int, int] = {}
        """Local rank -> global rank, from the hellos (torchrun names log folders by local
        rank; on a node other than the first the two differ)."""
        self._stopping = False
        """A planned stop is under way: torchrun's own complaints about it (its
        SignalException traceback) stay in the attempt's launcher.log, off the console."""
        self.printed = PrintedProgress(plan.config.stdout, run_dir,
                                       single_node=not plan.config.launch.multinode)
        """Stdout mode: progress read from the output of a script that never attaches."""
        self.standby: standby.Standby | None = None
        """The next attempt's workers, started ahead and waiting in ``attach()``."""
        self.standby_entries: list[tuple[str, dict[str, object]]] = []
        """Journal entries about the standby, for the caller to take."""
        self._launchers: set[int] = set()
        """The torchrun pids of the running attempt and the standby (``WorkerGroup.siblings``)."""
        self.ahead: tuple[int, launcher.WorkerGroup] | None = None
        """The next attempt's torchrun, started ahead (``node.ahead``), and that attempt."""
        self.launched_ahead = False
        """The running attempt's torchrun was started ahead."""
        self._ahead_failed = False
        """One started ahead exited on its own: this run starts none again."""
        self._early = early
        launch = plan.config.launch
        self._ahead_on = launch.torchrun_ahead and \
            standby.off_reason(launch, standby.gpus_visible(launch)) is not None
        """torchrun is started ahead where no warm standby can serve a relaunch."""
        saving = plan.config.checkpoints
        self.memory = shm.NodeMemory.of(plan.shared_dir, plan.node_rank)
        """This node's folder in shared memory: the ranks' marks and memory copies
        (``node.shm``), removed when the run ends here."""
        self.keepers = last_step.Keepers(self.token.hex(), self.memory.marks) \
            if saving.just_in_time and saving.every_steps > 0 else None
        """The ranks' keepers of their last completed step (``node.just_in_time``), when the
        run keeps one: babysit saves its checkpoints and ``checkpoints.just_in_time`` is on."""
        self.budget = last_step.Budget(saving.just_in_time_timeout_s)
        self.attempt = -1
        self.resumed_step = 0
        """The step the running attempt resumed from (0: from scratch)."""
        self.world_size = plan.world_size or 0
        """The job's ranks, from the hellos (the config's until one came)."""
        self._kept: int | None = None
        """The attempt whose just-in-time save was made (once per attempt)."""
        self.keeping: dict[int, bool] = {}
        """Rank -> its hello said it keeps its last step (``rank.just_in_time``)."""
        self._told_off = False
        self.reports = reports.Reports(self.attempt_dir(0) / "launcher.log", lambda _: None)
        """The running attempt's tracebacks and torchrun's report on their way to the console
        (``node.reports``)."""

    def open(self) -> None:
        self.intake.open()
        self.printed.start()
        swept = self.memory.open()
        if swept:  # another run's, whose babysitter died without removing it
            self.standby_entries.append(("shared_memory_swept", {
                "paths": [str(p) for p in swept],
                "summary": f"removed {len(swept)} folder(s) of shared memory that babysitters "
                           f"gone from this node left behind"}))
        fallback = self.memory.fallback
        if fallback is not None:  # said once: this node's folder is made once a run
            self.standby_entries.append(("shared_memory_fallback", {
                "path": str(self.memory.root), "summary": f"no shared memory: {fallback}"}))

    def telemetry(self) -> list[RankStep | protocol.WorkerEvent]:
        """Every report queued on the socket, then what the ranks' printed progress said since
        the last call (stdout mode; nothing once a rank attached)."""
        return self.printed.take(self.intake.drain(), time.time(), time.monotonic(),
                                 self._local_pid)

    def _local_pid(self, local_rank: int) -> int | None:
        """Stdout mode announces its printing rank: learn every local rank's pid then, so a
        hang's stack dumps and the liveness check cover the ranks that print nothing too."""
        if self.group is None:
            return None
        for rank, pid in rank_pids(self.group.processes()).items():
            self.rank_pids.setdefault(self.global_rank.get(rank, rank), pid)
        return self.rank_pids.get(local_rank)

    def restore_script_checkpoint(self, remedy: Remedy | None, attempt: int) -> list[Entry]:
        """Stdout mode, before launching ``attempt`` for ``remedy``: put back the script's own
        checkpoint copy it needs; the attempt then runs with ``stdout.resume_args``."""
        aside = self.run_dir / "script_checkpoints" / f"set-aside-attempt-{attempt}"
        return self.printed.restore(remedy, aside)

    def close(self) -> None:
        if self.group is not None and self.group.processes():
            if self.keepers is not None:  # so that ranks holding on at their end do not wait
                self.keepers.release(self.attempt, self.rank_pids)
            self.group.stop(self.plan.config.launch.stop_grace_s)
        self.drop_standby("the run ended")
        self._drop_ahead()
        if self._early is not None:
            self._early.stop()
        self.intake.close()
        self.memory.close()
        if self.keepers is not None:
            shutil.rmtree(self.keepers.marks_root, ignore_errors=True)

    def attempt_dir(self, attempt: int) -> Path:
        return self.run_dir / "attempts" / str(attempt)

    def launch(self, attempt: int, directive: Directive, *, rdzv_endpoint: str, rdzv_id: str,
               nnodes: str | None = None, node_rank: int | None = None,
               place: launcher.Placement | None = None) -> list[str]:
        """Start attempt ``attempt`` with ``directive``; returns the torchrun command.
        ``nnodes``/``node_rank`` replace the config's for this attempt (a multi-node leader
        decides which nodes take part); ``place`` says where this node stands in it (who hosts
        the rendezvous, which address this node is reached at)."""
        attempt_dir = self.attempt_dir(attempt)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        standby.set_aside(attempt_dir)
        directive = self._keeping(attempt, directive)
        directive.write(attempt_dir / "directive.json")
        self.control.new_attempt(attempt_dir)
        launch = self.plan.config.launch
        if self.printed.resume_args:
            launch = launch.model_copy(
                update={"args": [*launch.args, *self.printed.resume_args]})
        if nnodes is not None or node_rank is not None:
            launch = launch.model_copy(update={
                "nnodes": nnodes if nnodes is not None else launch.nnodes,
                "node_rank": node_rank if node_rank is not None else launch.node_rank})
        extra_env: dict[str, str] = {}
        if place is not None:
            launch, extra_env = place.apply(launch, {**os.environ, **launch.env})
        command = launcher.torchrun_command(
            launch, self.plan.script, python=self.plan.python, rdzv_id=rdzv_id,
            rdzv_endpoint=rdzv_endpoint, log_dir=attempt_dir / "torchrun",
            shielded=shield.shielded())
        self._new_attempt()
        env = {**self._env(attempt_dir, attempt), **extra_env}
        self.group = self._from_early(command, env, attempt_dir) or \
            self._from_ahead(attempt, command, env)
        self.launched_ahead = self.group is not None
        if self.group is None:
            self.group = self._group(command, attempt_dir, attempt, self.lines, env)
        return command

    # -- torchrun started ahead (node.ahead) ---------------------------------------------------

    def keep_ahead(self, attempt: int) -> None:
        """Start attempt ``attempt``'s torchrun ahead, unless one is up for it already, it is
        off (``launch.torchrun_ahead``), or a warm standby serves this run's relaunches.
        Journal (``ahead_exited``) and forget one that ended on its own."""
        if self._ahead_fits(attempt) or not self._ahead_on or self._ahead_failed:
            return
        attempt_dir = self.attempt_dir(attempt)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        group = launcher.WorkerGroup(
            ahead.command(self.plan.python), self._env(attempt_dir, attempt), Path.cwd(),
            attempt_dir / "launcher.log", queue.Queue(maxsize=10_000),
            self.plan.config.launch.role, siblings=self._launchers, fed=True)
        group.start()
        assert group.pid is not None
        self._launchers.add(group.pid)
        self.ahead = (attempt, group)

    def _from_early(self, command: list[str], env: dict[str, str], attempt_dir: Path
                    ) -> launcher.WorkerGroup | None:
        """The torchrun ``babysit run`` started first thing, now running ``command``, at this
        node's first launch; None (and it stopped) when it does not fit (``Early.unfit``), and
        at every later launch."""
        early, self._early = self._early, None
        if early is None:
            return None
        launch = self.plan.config.launch
        why = early.unfit(self.plan.python, launch.env, launch.torchrun_ahead, command)
        if why is not None:
            early.stop()
            self.standby_entries.append(("ahead_unused", {"why": why}))
            return None
        proc = early.take()
        if proc is None:  # it ended on its own
            return None
        group = launcher.WorkerGroup(
            ahead.command(early.python), early.env, Path.cwd(), attempt_dir / "launcher.log",
            self.lines, launch.role, siblings=self._launchers, fed=True)
        group.start(proc)
        self._launchers.add(proc.pid)
        return self._feed(group, command, env)

    def _ahead_fits(self, attempt: int) -> bool:
        """A torchrun started ahead is up for ``attempt``; one for another attempt, or one that
        exited on its own, is dropped."""
        if self.ahead is None:
            return False
        if self.ahead[0] == attempt and self.ahead[1].poll() is None:
            return True
        self._drop_ahead()
        return False

    def _from_ahead(self, attempt: int, command: list[str], env: dict[str, str]
                    ) -> launcher.WorkerGroup | None:
        """The torchrun started ahead for ``attempt``, now running ``command``; None (and any
        other stopped) when there is none fit for it."""
        if self.ahead is None or not self._ahead_fits(attempt):
            return None
        _, group = self.ahead
        self.ahead = None
        fed = self._feed(group, command, env)
        if fed is not None:
            fed.redirect(self.lines)
        return fed

    def _feed(self, group: launcher.WorkerGroup, command: list[str], env: dict[str, str]
              ) -> launcher.WorkerGroup | None:
        """``group``, a torchrun started ahead, made to run ``command`` with ``env`` (its
        ``ahead.Order``); None, and it stopped, when it cannot run it or is gone."""
        order = ahead.Order.of(command, env, str(Path.cwd()))
        if order is None or not group.feed(order.encode(), command, env,
                                           keep_open=order.hold is not None):
            self._stop_group(group)
            return None
        return group

    def _drop_ahead(self) -> None:
        """Stop the torchrun started ahead, if any. One that exited on its own (not babysit's
        interpreter, or no babysit in ``launch.python``) is journaled, and none starts again."""
        if self.ahead is None:
            return
        (attempt, group), self.ahead = self.ahead, None
        exited = group.poll()
        if exited is not None:
            self._ahead_failed = True
            self.standby_entries.append(("ahead_exited", {
                "for_attempt": attempt, "exit_code": exited,
                "tail": launcher.tail(group.log_path, 4096)}))
        self._stop_group(group)

    def _stop_group(self, group: launcher.WorkerGroup, grace_s: float | None = None) -> int | None:
        """Stop a group that trained nothing (a standby, a torchrun started ahead) and forget
        its launcher; its exit code. ``grace_s``: SIGTERM -> SIGKILL (None: the standby's)."""
        if grace_s is None:
            grace_s = min(standby.STOP_GRACE_S, self.plan.config.launch.stop_grace_s)
        code = group.stop(grace_s)
        if group.pid is not None:
            self._launchers.discard(group.pid)
        return code

    def _keeping(self, attempt: int, directive: Directive) -> Directive:
        """``directive`` for this node's ranks of ``attempt``: where they mark each step and how
        long an ending one holds on (``just_in_time``), when the run keeps the last step; where
        and how often they copy their state into this node's shared memory (``memory``), and,
        resuming from a memory copy, this node's folder of it."""
        if self.keepers is not None and self.attempt >= 0:
            self.keepers.forget(self.attempt)
        self.attempt = attempt
        self.resumed_step = directive.resume.step if directive.resume is not None else 0
        resume = directive.resume
        if resume is not None and resume.memory is not None:
            directive = replace(directive, resume=replace(
                resume, memory=str(on_node(self.memory.root, resume.memory))))
        every = directive.memory.get("every", self.plan.config.checkpoints.memory_every_steps)
        if self.plan.config.checkpoints.every_steps > 0 and every != 0:
            directive = replace(directive, memory={"root": str(self.memory.root),
                                                   "every": every,
                                                   "node": self.plan.node_rank})
        if self.keepers is None:
            return directive
        return replace(directive, just_in_time=self.keepers.settings(attempt, self.budget))

    def keep_last_step(self, fault: str, others: last_step.Part | None = None,
                       world_size: int | None = None) -> last_step.Outcome | None:
        """After ``fault``, before anything is stopped: the just-in-time save of the last
        completed step (``node.last_step.save``) from this node's ranks and, on a
        multi-node leader, the ``others`` nodes' (``world_size``: the whole job's ranks).
        None when the run keeps none, no rank here attached, or this attempt's was made."""
        if self.keepers is None or self._kept == self.attempt or \
                not any(self.keeping.get(r) for r in self.rank_pids):
            return None
        self._kept = self.attempt
        parts: list[last_step.Part] = [last_step.OwnRanks(self.keepers, self.rank_pids)]
        if others is not None:
            parts.append(others)
        return last_step.save(
            parts, self.attempt, root=Path(self.plan.checkpoint_dir),
            world_size=world_size or self.world_size or len(self.rank_pids),
            since_step=self.resumed_step, fault=fault,
            budget_s=self.budget.seconds(crash=fault != "hang"))

    def _new_attempt(self) -> None:
        # Anything still queued belongs to the attempt being replaced.
        self.intake.forget_connections()
        self.rank_pids = {}
        self.closed_ranks = set()
        self.global_rank = {}
        self.keeping = {}
        self.printed.new_attempt()
        self._stopping = False
        attempt_dir = self.attempt_dir(self.attempt)
        self.reports = reports.Reports(attempt_dir / "launcher.log",
                                       lambda local: launcher.rank_logs(attempt_dir).get(local))
        if self.group is not None and self.group.pid is not None:
            self._launchers.discard(self.group.pid)

    def _group(self, command: list[str], attempt_dir: Path, attempt: int,
               lines: queue.Queue[launcher.OutputLine],
               env: dict[str, str] | None = None) -> launcher.WorkerGroup:
        group = launcher.WorkerGroup(command, env or self._env(attempt_dir, attempt),
                                     Path.cwd(), attempt_dir / "launcher.log", lines,
                                     self.plan.config.launch.role, siblings=self._launchers)
        group.start()
        assert group.pid is not None
        self._launchers.add(group.pid)
        return group

    # -- the warm standby (node.standby) ------------------------------------------------------

    def start_standby(self, attempt: int, kind: standby.Kind = "full", *, rdzv_endpoint: str,
                      rdzv_id: str, at_stall: bool = False) -> None:
        """Start ``attempt``'s workers now, to wait in ``attach()`` (``kind`` full) or before
        the script (imports) until ``promote``. Only for a run whose ``standby.off_reason`` is
        None (single node, its own rendezvous)."""
        attempt_dir = self.attempt_dir(attempt)
        folder = attempt_dir / standby.FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        command = launcher.torchrun_command(
            self.plan.config.launch, self.plan.script, python=self.plan.python,
            rdzv_id=rdzv_id, rdzv_endpoint=rdzv_endpoint, log_dir=attempt_dir / "torchrun",
            prewarm=kind == "imports", shielded=shield.shielded())
        group = self._group(command, attempt_dir, attempt, queue.Queue(maxsize=10_000),
                            {**self._env(attempt_dir, attempt), **standby.environment(folder)})
        self.standby = standby.Standby(attempt, group, folder, rdzv_endpoint, kind,
                                       at_stall=at_stall)
        self.standby_entries.append(("standby_started", {
            "for_attempt": attempt, "pid": group.pid, "rdzv_endpoint": rdzv_endpoint,
            "kind": kind, "at_stall": at_stall}))

    def hold_standby(self, hold: bool) -> None:
        """Pause a standby that is still starting while ``hold`` (a stall is looming or being
        confirmed), and continue it once not. Its start-up (every rank importing torch) takes
        the CPU the confirmation needs: with 24 ranks on 2 cores the stack reads took 20 s
        beside it, 1 s without it. A standby that is ready, or has warmed for
        ``standby.WARMING_MAX_S``, is never paused, nor one started at this stall."""
        spare = self.standby
        if spare is None or spare.at_stall:
            return
        pause = hold and spare.warming(time.time())
        if pause != spare.paused:
            spare.group.pause(pause)
            spare.paused = pause

    def promote(self, attempt: int, directive: Directive) -> standby.Standby | None:
        """Make the standby attempt ``attempt``, with ``directive``: the cold ``launch`` minus
        starting anything. None (and any standby stopped, journaled) when there is none fit for
        it: one for another attempt, or one a process of which is gone (``Standby.lost``)."""
        self.hold_standby(False)
        spare, self.standby = self.standby, None
        if spare is None:
            return None
        nproc = self.plan.config.launch.nproc_per_node
        lost = spare.lost(nproc if isinstance(nproc, int) else None)
        if spare.attempt != attempt or lost is not None:
            self._discard(spare, f"{lost}: the relaunch starts cold" if lost is not None
                          else f"it was for attempt {spare.attempt}")
            return None
        attempt_dir = self.attempt_dir(attempt)
        self._keeping(attempt, directive).write(attempt_dir / "directive.json")
        self.control.new_attempt(attempt_dir)
        self._new_attempt()
        self.group = spare.group
        spare.group.redirect(self.lines)
        spare.promote()
        return spare

    def standby_exit(self) -> None:
        """Journal (and forget) a standby that ended on its own: never this attempt's crash."""
        if self.standby is not None and self.standby.group.poll() is not None:
            spare, self.standby = self.standby, None
            self._discard(spare, "it exited on its own")

    def take_standby_entries(self) -> list[tuple[str, dict[str, object]]]:
        """The journal entries about the standby since the last call (``standby_entries``)."""
        entries, self.standby_entries = self.standby_entries, []
        return entries

    def drop_standby(self, reason: str, at_once: bool = False) -> None:
        """Stop the standby's whole process tree, if there is one. ``at_once``: kill it without
        a grace period (no attempt will take it, and the job's own ranks are exiting: a
        standby's orderly shutdown, its interpreters' teardown with torch loaded, would take
        their CPU and hold this loop, 0.9 s here, before it sees the job end)."""
        if self.standby is not None:
            spare, self.standby = self.standby, None
            self._discard(spare, reason, 0.0 if at_once else None)

    def _discard(self, spare: standby.Standby, reason: str,
                 grace_s: float | None = None) -> None:
        exited = spare.group.poll()
        # Even after torchrun exited: ranks it left behind are ours (subreaper) to stop.
        code = self._stop_group(spare.group, grace_s)
        if exited is None:
            self.standby_entries.append(("standby_stopped", {
                "for_attempt": spare.attempt, "reason": reason, "exit_code": code}))
        else:  # its logs move under attempts/N/standby/ if attempt N starts cold
            self.standby_entries.append(("standby_exited", {
                "for_attempt": spare.attempt, "exit_code": exited,
                "tail": launcher.tail(spare.group.log_path, 4096)}))

    def _env(self, attempt_dir: Path, attempt: int) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # so rank output reaches the console live
        env.update(self.plan.config.launch.env)
        # NCCL's flight recorder dumps into the attempt's folder (unless the user chose), each
        # setting under the name the ranks' torch reads (an old name read makes torch warn).
        env.update(flight_recorder.environment(
            attempt_dir, env, flight_recorder.torch_reads(self.plan.python)))
        flight_recorder.prepare(attempt_dir)
        env.update({
            protocol.ENV_SOCKET: str(self.intake.path),
            protocol.ENV_TOKEN: self.token.hex(),
            protocol.ENV_RUN_DIR: str(self.run_dir),
            protocol.ENV_ATTEMPT: str(attempt),
            protocol.ENV_DIRECTIVE: str(attempt_dir / "directive.json"),
        })
        return env

    def note(self, event: protocol.WorkerEvent) -> None:
        """Keep what a rank's hello, keeps and close say about its process."""
        if event.type == "hello":
            pid = event.data.get("pid")
            if isinstance(pid, int) and pid > 0:
                self.rank_pids[event.rank] = pid
            world = event.data.get("world_size")
            if isinstance(world, int) and world > 0:
                self.world_size = world
            self._keeps(event)
            local = event.data.get("local_rank")
            if isinstance(local, int) and local >= 0:
                self.global_rank[local] = event.rank
        elif event.type == "keeps":  # a keeper started after attach() (run.keep), or not
            self._keeps(event)
        elif event.type == "close":
            self.closed_ranks.add(event.rank)
        elif event.type == "checkpoint" and not event.data.get("external"):
            took = event.data.get("write_s", event.data.get("blocking_s"))
            if isinstance(took, (int, float)):
                self.budget.saved(float(took))  # how long a just-in-time save may take

    def _keeps(self, hello: protocol.WorkerEvent) -> None:
        """Whether the rank keeps its last step; the first time one says why it does not (or
        the script never attached: stdout mode, where babysit saves no checkpoint of its own and
        so keeps none either), journaled once for the run. A hello that says the rank keeps it
        later (a framework's loop builds its optimizer after ``attach()``) leaves it to the
        rank's ``keeps`` event."""
        printed = hello.data.get("source") == SOURCE
        if self.keepers is None and not (printed and self.plan.config.checkpoints.just_in_time):
            return
        if hello.data.get("keeps_later") is True:
            return
        keeps = hello.data.get("keeps")
        self.keeping[hello.rank] = keeps is True
        if keeps is not True and not self._told_off:
            self._told_off = True
            why = str(hello.data.get("keeps_not") or (
                "the script prints its progress instead of attaching (stdout mode): babysit "
                "has no view of its optimizer"))
            self.standby_entries.append(("just_in_time_off", {
                "why": why, "rank": hello.rank, "summary": f"no just-in-time state in this "
                f"run: {why}; a fault resumes from the newest checkpoint"}))

    @property
    def all_closed(self) -> bool:
        """Every rank that said hello in this attempt has closed its run (and one did)."""
        return bool(self.rank_pids) and set(self.rank_pids) <= self.closed_ranks

    def teardown_only(self, code: int, attempt: int) -> bool:
        """torchrun's non-zero ``code`` came only from the process teardown after every rank
        closed its run (``teardown.teardown_only``)."""
        return self.all_closed and teardown.teardown_only(code, self.attempt_dir(attempt))

    def tails(self, attempt: int, max_bytes: int = 16384) -> dict[int, str]:
        """The end of each rank's stderr log of ``attempt``, by global rank (from the hellos,
        else from torchrun's failure summary for a rank that died before its hello)."""
        attempt_dir = self.attempt_dir(attempt)
        known = {**launcher.failed_ranks(launcher.tail(attempt_dir / "launcher.log")),
                 **self.global_rank}
        return {known.get(local, local): launcher.tail(path, max_bytes)
                for local, path in launcher.rank_logs(attempt_dir).items()}

    def crash_evidence(self, attempt: int) -> tuple[dict[int, str], int | None]:
        """Each rank's log tail, and the rank torchrun names as the first observed failure."""
        summary = launcher.tail(self.attempt_dir(attempt) / "launcher.log")
        return self.tails(attempt), launcher.root_cause_rank(summary)

    def failure_summarized(self, attempt: int) -> bool:
        """torchrun printed its failure summary for ``attempt`` (``launcher.failure_summarized``):
        every rank is stopped and what failed is on record, though torchrun has not exited."""
        return launcher.failure_summarized(
            launcher.tail(self.attempt_dir(attempt) / "launcher.log", 8192))

    def rank_exits(self, attempt: int) -> dict[int, int]:
        """Global rank -> exit code of each rank torchrun reported failed in ``attempt``
        (``launcher.rank_exits``); empty when torchrun printed no summary (it was killed)."""
        return launcher.rank_exits(launcher.tail(self.attempt_dir(attempt) / "launcher.log"))

    def poll(self) -> int | None:
        """torchrun's exit code once it ended, else None (also None before any launch)."""
        return self.group.poll() if self.group is not None else None

    @property
    def running(self) -> bool:
        return self.group is not None and self.group.poll() is None

    def pids(self) -> list[int]:
        return [p.pid for p in self.group.processes()] if self.group is not None else []

    def stop(self, replacing: bool = False) -> int | None:
        """Stop every process of the attempt (politely, then not); torchrun's exit code.
        ``replacing``: another attempt follows, so torchrun is killed as soon as its ranks are
        gone rather than waited for (its own shutdown is about 0.5 s of every relaunch, and
        nothing in it is babysit's to keep: the ranks' logs are on disk)."""
        if self.group is None:
            return None
        self._stopping = True
        if self.keepers is not None:  # so that ranks holding on at their end do not wait
            self.keepers.release(self.attempt, self.rank_pids)
        return self.group.stop(self.plan.config.launch.stop_grace_s,
                               launcher_grace_s=0.0 if replacing else None)

    def release_store(self) -> None:
        """The attempt's torchrun may let the rendezvous store it hosts go once it is done: no
        other node's torchrun needs it any more (``ahead.Order.hold``)."""
        if self.group is not None:
            self.group.release()

    def end_now(self) -> int | None:
        """Stop a torchrun whose ranks are done instead of waiting for its exit: it already
        reported their failure (``failure_summarized``), or they all closed their run and its
        teardown hangs (in its exit barrier, waiting for a node whose rank aborted). Unlike
        ``stop``, what it prints still reaches the console."""
        if self.group is None:
            return None
        return self.group.stop(self.plan.config.launch.stop_grace_s, launcher_grace_s=0.0)

    def output(self) -> Iterator[str]:
        """The lines printed since the last call, for the console, prefixed with the rank (or
        ``torchrun``). Every line also goes to stdout mode; the console shows a redrawn
        progress bar's newest state only, the ranks ``launch.local_ranks_filter`` names, a
        traceback as one line and of torchrun's failure report only the line naming its log
        (``node.reports``), and nothing of torchrun's own during a planned stop (all of it
        stays in the logs)."""
        shown = self.plan.config.launch.local_ranks_filter
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            self.printed.line(line.rank, line.text, time.time())
            if line.rank is None and self._stopping:
                continue
            if line.rank is None or shown is None or line.rank in shown:
                yield from self.reports.line(line)
        if self.group is not None and self.group.poll() is not None:  # its output has ended
            yield from self.reports.flush()
