"""This node's GPUs, as the machine's witness: a fault NVML reports becomes a finding.

A GPU that raises an uncorrectable ECC error or a machine Xid (``health.MACHINE_XIDS``: fallen
off the bus, an NVLink error, row remapping ...) is the machine's fault, whatever the job does
next: the rank on it may crash, hang, or go on computing with wrong bits. Every node's
babysitter looks at its own GPUs every ``schedule.health_every_s`` (the same NVML reads as the
health sampler's, on the control loop: a few ms); what it finds names this node's ranks
(``Incident.GPU_FAULT``), and the run's policy answers it (``incidents.gpu_fault``: roll back,
nothing skipped, LR kept). A memory error (new uncorrectable ECC errors, a memory Xid) may have
changed what was computed since the last clean look: its onset is the step after that look,
and the rollback goes back before it. A GPU that stopped (fallen off the bus, NVLink, its GSP)
computed nothing wrong before it stopped: its onset is the step it was seen at. On a
multi-node run the leader evicts the node at once (``cluster.eviction``): no second chance,
as for a silent data corruption.

Without NVML (no GPU, no driver, ``nvidia-ml-py`` not installed) it looks once, says why in
``unavailable``, and never again. Every GPU NVML sees counts, also those the job was not given
(``CUDA_VISIBLE_DEVICES``): a machine whose GPU fails is taken out whichever one it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from babysit.policies.types import Finding, Incident, Severity
from babysit.supervisor.services.health import GpuSample, Nvml, machine_faults, may_corrupt


class GpuWatch:
    """``look(now, step, ranks)`` each tick: a finding when a look every ``every_s`` seconds
    found a machine fault on one of this node's GPUs, else nothing."""

    def __init__(self, every_s: float | None, nvml: Nvml | None = None) -> None:
        self.every_s = every_s
        self.nvml = nvml if nvml is not None else Nvml()
        self.unavailable: str | None = None
        """Why the GPUs cannot be read (set at the first look that failed)."""
        self._next = 0.0
        self._before: dict[int, GpuSample] = {}
        self._clean_step = 0
        """The step of the last look that found nothing: the faults came after it."""

    def look(self, now: float, step: int, ranks: Iterable[int]) -> list[Finding]:
        if self.every_s is None or self.unavailable is not None or now < self._next:
            return []
        self._next = now + self.every_s
        gpus, why = self.nvml.read()
        if gpus is None:
            self.unavailable = why or "NVML unavailable"
            return []
        faults = {g.index: what for g in gpus
                  if (what := machine_faults(g, self._before.get(g.index)))}
        memory = any(may_corrupt(g, self._before.get(g.index)) for g in gpus
                     if g.index in faults)
        self._before = {g.index: g for g in gpus}
        if not faults:
            self._clean_step = step
            return []
        said = describe({str(i): what for i, what in faults.items()})
        return [Finding(
            incident=Incident.GPU_FAULT, detector="gpu", severity=Severity.CRITICAL,
            step=step, onset_step=min(self._clean_step + 1, step) if memory else step,
            ranks=tuple(sorted(ranks)),
            message=f"GPU fault at step {step}: {said} (the machine's; clean at step "
                    f"{self._clean_step}" + ("; results since may be wrong)" if memory else ")"),
            evidence={"gpus": {str(i): what for i, what in faults.items()},
                      "clean_step": self._clean_step, "memory": memory})]

    def close(self) -> None:
        self.nvml.close()


def describe(gpus: Mapping[str, Sequence[str]]) -> str:
    """A ``gpu_fault`` finding's ``gpus`` evidence in words: "GPU 0: Xid 79 (...); GPU 3: ..."."""
    return "; ".join(f"GPU {index}: {', '.join(what)}" for index, what in gpus.items())
