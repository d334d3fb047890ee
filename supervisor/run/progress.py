"""What the run looks like from the outside, kept up to date from merged steps and findings.

The run's steps (``StepLog.listen``) and findings (``Journal.listen``) feed ``RunProgress``; it
answers with the live status line, the snapshot the digest and the Prometheus exporter read, and
the summary printed at the end. Pure bookkeeping: no I/O, times come from the records.

Throughput figures are medians over the last steps, and only what the script reported: without
``tokens`` there is no tokens/s; without FLOPs per token and peak FLOP/s there is no MFU.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from babysit.policies import decide as sm
from babysit.policies.types import Action, JobStep
from babysit.supervisor.services.schedule import DigestSnapshot

RATE_WINDOW = 32
"""Steps in the medians of tokens/s and MFU."""


class RunProgress:
    def __init__(self) -> None:
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, step)
        self._tokens: deque[float] = deque(maxlen=RATE_WINDOW)
        self._mfu: deque[float] = deque(maxlen=RATE_WINDOW)
        self.loss: float | None = None
        self.interventions = 0
        self.last_incident: str | None = None

    def observe(self, record: JobStep) -> None:
        if self._recent and record.step <= self._recent[-1][1]:
            # A relaunch resumed behind the last step seen (a rollback, a crash): the rate is
            # this attempt's, never a negative one across the jump back.
            self._recent.clear()
        self._recent.append((record.time, record.step))
        self.loss = record.loss
        if record.tokens_per_s is not None:
            self._tokens.append(record.tokens_per_s)
        if record.mfu is not None:
            self._mfu.append(record.mfu)

    def hear(self, entry: dict[str, Any]) -> None:
        """A ``finding`` journal entry: one whose remedy does something is an incident."""
        if entry.get("remedy", {}).get("action") != Action.IGNORE.value:
            finding = entry["finding"]
            self.interventions += 1
            self.last_incident = f"{finding['incident']}@{finding['step']}"

    def steps_per_s(self) -> float | None:
        if len(self._recent) < 2:
            return None
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def tokens_per_s(self) -> float | None:
        return statistics.median(self._tokens) if self._tokens else None

    def mfu(self) -> float | None:
        return statistics.median(self._mfu) if self._mfu else None

    def snapshot(self, machine: sm.Machine) -> DigestSnapshot:
        return DigestSnapshot(state=machine.state.value, attempt=machine.attempt,
                              step=machine.step or None, loss=self.loss,
                              steps_per_second=self.steps_per_s(),
                              tokens_per_second=self.tokens_per_s(), mfu=self.mfu(),
                              interventions=self.interventions,
                              last_incident=self.last_incident)

    def status_line(self, machine: sm.Machine) -> str:
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        rate = self.steps_per_s()
        parts = [f"babysit | {machine.state.value}", f"attempt {machine.attempt}",
                 f"step {machine.step}", f"loss {loss}",
                 f"{rate:.1f} steps/s" if rate is not None else "- steps/s"]
        tokens, mfu = self.tokens_per_s(), self.mfu()
        if tokens is not None:
            parts.append(f"{si(tokens)} tok/s")
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        parts.append(f"last incident: {self.last_incident or 'none'}")
        return " | ".join(parts)

    def summary(self, machine: sm.Machine, elapsed_s: float, attempts: int,
                goodput: str = "", journal: str = "", code: int | None = None) -> str:
        """The run's last line: how it ended, and (when given) this session's ``goodput``
        summary, the ``journal``'s path and the exit ``code``."""
        loss = f"{self.loss:.4f}" if self.loss is not None else "n/a"
        mfu = self.mfu()
        speed = f", MFU {100 * mfu:.1f}%" if mfu is not None else ""
        line = (f"babysit: {machine.state.value} ({machine.reason}) after {elapsed_s:.1f} s, "
                f"{attempts} attempt(s), step {machine.step}, last loss {loss}{speed}, "
                f"{self.interventions} incident(s).")
        if goodput:
            line += f" {goodput[:1].upper()}{goodput[1:]}."
        if journal:
            line += f" Journal: {journal}; exit code {code}."
        return line


def si(value: float) -> str:
    """41234.5 -> "41.2k": a rate at a glance."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}"
