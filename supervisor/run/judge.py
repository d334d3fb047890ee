"""A finding's remedy, and the evidence for a disruptive one: the loop's "judge" stage.

``Judge.finding`` asks the policy (``Watch.judge``: the rules' ladder, and a rollback's plan
from the checkpoints on the shelf, babysit's or stdout mode's copies), writes an
incident folder for a remedy that ends the workers (the ranks' stacks for a hang, their log
tails), and journals the ``finding``: the services, the cadence, the recovery and the progress
line hear it there. ``Judge.end`` turns an attempt's end into the state machine's event, a
crash classified (most specific verdict first), located and judged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from babysit.policies import decide as sm
from babysit.policies.types import Action, Finding, Incident, Remedy
from babysit.supervisor.node import incident
from babysit.supervisor.run.members import JobEnd, Members
from babysit.supervisor.run.record import Record
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch

DISRUPTIVE = (Action.ROLLBACK, Action.RELAUNCH, Action.STOP)
"""Remedies that end the workers: each gets an incident folder."""


class Judge:
    """Calling rules: from the loop's thread, once per finding the loop acts on."""

    def __init__(self, run_dir: Path, watch: Watch, recovery: Recovery, members: Members,
                 record: Record, log: Callable[[str], None]) -> None:
        self.run_dir, self.watch, self.recovery = run_dir, watch, recovery
        self.members, self.record, self._log = members, record, log
        self.incident_dir: Path | None = None
        """The last judged finding's incident folder (None: it was not disruptive); its alert
        links it."""

    def finding(self, finding: Finding, attempt: int) -> Remedy:
        # Wall-clock time: the rules' cooldowns and budget windows span hours and must survive
        # a supervisor restart, even across a reboot (the monotonic clock restarts at boot).
        # Which node and host its ranks are on; a machine's fault counts against that node.
        finding = self.members.locate(finding)
        shelf = self.members.shelf(finding, self.recovery.shelf())
        remedy = self.members.shape_remedy(self.watch.judge(finding, time.time(), shelf))
        self.incident_dir = None
        if remedy.action in DISRUPTIVE:
            # The alert's title says what babysit does; this line says what it saw.
            self._log(f"babysit: {finding.message}")
            diagnosis = self.members.diagnosis(finding) \
                if finding.incident is Incident.HANG else None
            self.incident_dir = incident.write_incident(
                self.run_dir, attempt, finding, remedy, diagnosis, self.members.tails(attempt))
            self.record.write("incident", dir=str(self.incident_dir),
                              incident=finding.incident.value, ranks=list(finding.ranks))
        # The finding as judged: marked with what the rules made of it (a rerun asked for, the
        # data it follows), so a supervisor taking over reads the same remedy back.
        self.record.write("finding", finding=remedy.finding.to_json(), remedy=remedy.to_json())
        self.record.write("watch_state", state=self.watch.state_dict())
        return remedy

    def end(self, end: JobEnd, attempt: int, step: int) -> sm.Exited:
        """The attempt's workers ended at ``step`` (the loop's count): 0, or a crash judged."""
        if end.code == 0:
            return sm.Exited(0)
        crash = self.watch.classify_crash(end.code, end.tails, step, end.root, end.exits)
        return sm.Exited(end.code, self.finding(crash, attempt))
