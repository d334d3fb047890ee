"""The supervisor's judgement for one run: detectors, the policy's rules, and resume directives.

``Watch`` holds everything that decides *what* is wrong and *what the policy says*; it does no
I/O and reads no clock (times are passed in), so the loop stays about side effects and this stays
testable. It is the one place that knows which detector observes which stream.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from babysit.policies.cause import ATTACHED
from babysit.policies.detectors import HangDetector, classify
from babysit.policies.detectors.crash import (
    STOP_SIGNALS,
    CrashClass,
    CrashSignature,
    CrashVerdict,
)
from babysit.policies.detectors.resume_data import GlobalBatch, ResumeData
from babysit.policies.detectors.resume_loss import ResumeLoss
from babysit.policies.detectors.sdc import SdcDetector
from babysit.policies.loader import load_policy
from babysit.policies.pipeline import Pipeline
from babysit.policies.rerun import REPRODUCED, Rerun, Seen, Trace, Verdict, asked
from babysit.policies.rollback import Known, Orders, Plan, Shelf
from babysit.policies.schema import Policy
from babysit.policies.types import (
    Action,
    Finding,
    Incident,
    JobStep,
    RankStep,
    Remedy,
    Severity,
    StepRecord,
)
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.directive import (
    Directive,
    LrRamp,
    Resume,
    SkipRange,
    merge_skips,
)
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.aggregate import PER_RANK_LIMIT
from babysit.supervisor.run.recovery import Entry
from babysit.supervisor.run.rollback import RollbackPlan, in_directive, lr_orders, plan_relaunch


@dataclass(frozen=True, slots=True)
class SdcCheck:
    """A completed silent-data-corruption check: every rank's digests at ``step`` compared."""

    step: int
    ranks: int
    finding: Finding | None
    """Set when a rank disagreed and was not already named in this attempt (a repeat of a
    named disagreement has ``agree`` False and no finding)."""
    last_agreeing_step: int | None

    @property
    def agree(self) -> bool:
        return self.last_agreeing_step == self.step


_SPECIFICITY = [CrashClass.DATA, CrashClass.USER_CODE, CrashClass.OOM, CrashClass.HARDWARE,
                CrashClass.NUMERICAL, CrashClass.KILLED, CrashClass.NETWORK, CrashClass.UNKNOWN]
"""Which rank to blame: a cause of its own before a peer's network error (usually the
consequence), and a fatal signal (SIGSEGV, SIGKILL) before that too."""


def _blame_order(verdict: CrashVerdict) -> int:
    """Rank of ``verdict`` in the blame order; a rank stopped by SIGTERM (torchrun stopping the
    survivors) comes last: it was stopped, it did not fail."""
    if verdict.crash_class is CrashClass.KILLED and verdict.signal in STOP_SIGNALS:
        return len(_SPECIFICITY)
    return _SPECIFICITY.index(verdict.crash_class)

_CURSOR_MEMORY = 4096
"""Recent steps remembered (data cursor, loss, grad norm): to turn a spike's onset step into
batches, and to hold a rerun against what the first pass saw."""
_PACE_MEMORY = 256
"""Recent step times whose median is the run's pace (a rerun's cost in seconds)."""


OWN_LOAD_BLIND = ("throughput", "straggler", "slow_compute", "slow_link")
"""The step detectors that do not judge steps taken under babysit's own load (``own_load``)."""


class Watch:
    def __init__(self, policy: Policy, checkpoint_every: int = 0,
                 checkpoint_dir: str | None = None, checkpoint_async: bool = False,
                 sdc_every: int = 0, scope: str = "all") -> None:
        """``scope`` picks the step detectors (``policies.pipeline.SCOPES``): a multi-node leader
        watches the job's global signals, each node its own ranks. ``checkpoint_dir`` is always
        passed to the workers: scripts that save their own checkpoints register them there even
        when babysit does not save (every = 0). ``checkpoint_every`` is the config's cadence;
        ``launch`` is told the one in force when ``checkpoints.cadence.auto`` adopted another."""
        self.policy = policy
        self.pipeline = Pipeline(policy, scope=scope)
        self.rules = self.pipeline.rules
        self.hang = HangDetector(policy.detectors.hang)
        self.sdc = SdcDetector(policy.detectors.sdc)
        self.sdc_every = sdc_every
        self.checkpoint_every = checkpoint_every
        self.skips: list[SkipRange] = []
        self.lr_scale = 1.0
        """The LR scale of the last attempt's directive (from its start)."""
        self.lr_ramp: LrRamp | None = None
        """...and how it wears off (a rollback's temporary cut), in cursor space."""
        self._planned: Plan | None = None
        """The plan of the newest rollback the rules chose (``judge``), for its launch."""
        self.reshard = False
        """Relaunches may change the world size (an elastic multi-node run)."""
        self.crashes: list[CrashSignature] = []
        self.trace = Trace(_CURSOR_MEMORY)
        self._pace: deque[float] = deque(maxlen=_PACE_MEMORY)
        self.rerun: Rerun | None = None
        """The rerun in flight: a spike's or a NaN's steps replayed to see whose it is."""
        self.verdicts: list[Verdict] = []
        """Reruns concluded since the caller last took them (``take_verdicts``)."""
        self._completed = 0
        """The newest step every rank completed this attempt, as far as known: the steps
        judged (``observe_record``), and the just-in-time state's (``hear``), which the ranks'
        keepers know however far the merged steps lag. Where a crash struck."""
        self._resume_failed = False
        """This attempt's resume did not take, by a rank's digest or by the loss (one finding
        per attempt)."""
        self._resume_loss: ResumeLoss | None = None
        """The loss check of this attempt's resume (``detectors/resume_loss.py``)."""
        self._batches = GlobalBatch() if scope != "node" else None
        """The job's global batches (a node's own ranks' share of one changes with the job's
        size by design: a node's watch keeps none)."""
        self._resume_data: ResumeData | None = None
        """The data check of this attempt's resume: the same global batch as before it
        (``detectors/resume_data.py``)."""
        self._resume: Resume | None = None
        """babysit's checkpoint this attempt resumed from (its directive's), if any."""
        self._streams: list[_Stream] = []
        """Where the data stream was, when the ranks draw with an ``ElasticSampler``: rank 0's
        ``stream`` event of each attempt of the run's line, oldest first: each attempt's counts
        from its cursor on (one that resumed further back replaces those past its cursor)."""
        self._rerun_streams: list[_Stream] = []
        """The line as the rerun in flight's first pass left it (``observe_stream``); its last
        report's global batch is the one the rerun must draw to replay the same samples."""
        self._rerun_from: int | None = None
        """The step the rerun in flight (or just concluded) resumed from."""
        self._first_record = True
        """No step of this attempt judged yet: the first one says where it resumed."""
        self._restored: int | None = None
        """The step of the checkpoint this attempt resumed from, as the supervisor knows it."""
        self._alive: set[int] = set()
        self._attached: set[int] | None = None
        """The ranks that said hello in this attempt, whichever node they are on (None: no
        attempt launched by this watch yet, as after a takeover: not known)."""
        self._world = 0
        self.own_load = False
        """babysit's own load is on the ranks' machine right now (the warm standby starting).
        Throughput and stragglers are not judged while it lasts: a slowdown babysit causes is
        not the run's."""
        self._checkpoint_dir, self._checkpoint_async = checkpoint_dir, checkpoint_async

    @classmethod
    def from_plan(cls, plan: RunPlan, scope: str = "all") -> Watch:
        ref = plan.config.policy
        name = ref.name
        if name.endswith((".yaml", ".yml")) or "/" in name:
            name = str((plan.base / name).resolve())
        overrides = dict(ref.overrides)
        restarts = plan.config.launch.max_restarts
        if restarts is not None:
            # torchrun's --max-restarts counts every failure alike; so does this override.
            crash = dict(overrides.get("crash", {}))
            crash["max_relaunches"] = dict.fromkeys((c.value for c in CrashClass), restarts)
            overrides["crash"] = crash
        c = plan.config.checkpoints
        watch = cls(load_policy(name, overrides), c.every_steps,
                    str(plan.checkpoint_dir), c.async_save, plan.config.sdc.every_steps, scope)
        low, high = plan.config.launch.node_range
        watch.reshard = low < high
        return watch

    # -- streams --------------------------------------------------------------------------------

    def new_attempt(self, now: float, directive: Directive,
                    restored: int | None = None) -> None:
        """A new attempt launched: only ranks that say hello are watched for hangs, so a script
        without the worker API is judged by liveness and exit code alone. ``restored``: the
        step of the checkpoint it resumes from when not babysit's (``directive.resume``): a
        stdout-mode script's own, put back."""
        self._alive = set()
        self._attached = set()
        self._completed = 0
        self._resume_failed = False
        self._resume_loss, self._first_record = None, True
        self._restored = directive.resume.step if directive.resume is not None else restored
        self._resume = directive.resume
        resumed = directive.resume.cursor if directive.resume is not None else 0
        self._streams = [st for st in self._streams if st.cursor <= resumed]
        if self._batches is not None:
            self._batches.new_attempt()
        self.hang.start(now)
        if directive.attempt > 0:
            self.pipeline.new_attempt()
            self.sdc.new_attempt()

    EVENTS = ("just_in_time",)

    def hear(self, entry: Mapping[str, Any]) -> None:
        """A journal entry of ``EVENTS``: the step of the just-in-time state gathered after a
        fault (saved or not) is one every rank completed this attempt (``_completed``)."""
        step = entry.get("checkpoint_step")
        if isinstance(step, int):
            self._completed = max(self._completed, step)

    def observe_rank(self, sample: RankStep, now: float) -> None:
        self.hang.observe(sample, now)

    def observe_event(self, event: WorkerEvent, now: float) -> None:
        if event.type == "hello":
            self._alive.add(event.rank)
            step = event.data.get("step")
            self.hang.hello(event.rank, step if isinstance(step, int) else 0, now)
        elif event.type == "close":
            self._alive.discard(event.rank)
        elif event.type == "phase":
            self.hang.phase(event.rank, str(event.data.get("name", "?")),
                            bool(event.data.get("begin")), now)

    def attached(self, rank: int) -> None:
        """``rank`` said hello in this attempt (``Record``: any node's rank): its start-up and
        restore are done, and from here on it draws its batches."""
        if self._attached is not None:
            self._attached.add(rank)

    def observe_stream(self, data: dict[str, Any]) -> list[Finding]:
        """Where this attempt's data stream is (rank 0's ``stream`` event, ``Run.batches``).
        A rerun in flight whose global batch is not its first pass's cannot replay the same
        samples: its verdict, ``UNDECIDED``, and the anomaly as the data's (a finding)."""
        try:
            stream = int(data["cursor"]), int(data["samples"]), int(data["global_batch"])
        except (KeyError, TypeError, ValueError):
            return []
        if stream[2] <= 0:
            return []
        self._streams = [st for st in self._streams if st.cursor < stream[0]]
        self._streams.append(_Stream(*stream))
        first = self._rerun_streams[-1].global_batch if self._rerun_streams else None
        if self.rerun is None or first in (None, stream[2]):
            return []
        # The rerun draws global batches of another size: at its cursors lie other samples.
        verdict = self.rerun.undecided(
            f"draws {stream[2]} samples a global batch where the first pass drew {first}, "
            "other samples at the same batches (the job's size changed)")
        self.rerun = None
        self.verdicts.append(verdict)
        self._streams = self._rerun_streams  # its batches are the first pass's, not these
        return [verdict.as_finding()]

    def samples_at(self, cursor: int) -> int | None:
        """Samples of the stream consumed before global batch ``cursor``, counted at the
        global batch of the attempt that drew it (the newest report at or before it; before
        the oldest, that one's); None where no rank reported a stream."""
        if not self._streams:
            return None
        st = next((st for st in reversed(self._streams) if st.cursor <= cursor),
                  self._streams[0])
        return max(0, st.samples + (cursor - st.cursor) * st.global_batch)

    def in_samples(self, skip: SkipRange) -> SkipRange:
        """``skip`` (batches of the run's line so far) with its span of the data stream, when
        the ranks reported one: the next attempt skips those samples at whatever world size it
        has."""
        first, end = self.samples_at(skip.start), self.samples_at(skip.end)
        if first is None or end is None or end <= first:
            return skip
        return SkipRange(skip.start, skip.end, (first, end))

    def ramp_in_samples(self, ramp: LrRamp) -> LrRamp:
        """``ramp`` with its cut, start and end as samples of the stream, as ``in_samples``."""
        points = [self.samples_at(c) for c in (ramp.cut, ramp.start, ramp.end)]
        if any(p is None for p in points):
            return ramp
        cut, start, end = (int(p or 0) for p in points)
        return LrRamp(ramp.cut, ramp.start, ramp.end, ramp.to, (cut, start, end))

    def observe_resume(self, event: WorkerEvent) -> Finding | None:
        """A rank's check at its first forward after a resume (``Run._check_restore``): a
        finding when it computes with other parameters than its checkpoint restored (one per
        attempt: every rank of a script that overwrites them says so)."""
        data = event.data
        if data.get("took", True) or self._resume_failed:
            return None
        self._resume_failed = True
        step = int(data.get("step", 0))
        return Finding(
            incident=Incident.RESUME, detector="resume", severity=Severity.CRITICAL, step=step,
            onset_step=step, ranks=(event.rank,),
            message=f"resume from step {step}: rank {event.rank} computes with other parameters "
                    "than its checkpoint restored -> the restore did not take (weights loaded "
                    "over the restored ones after attach(), say a 'load pretrained' line placed "
                    "after it? a model changed after attach()?)",
            evidence={"checkpoint_step": step, "restored": data.get("restored"),
                      "seen": data.get("seen")})

    def observe_fingerprint(self, event: WorkerEvent, world_size: int) -> SdcCheck | None:
        """One rank's silent-data-corruption digests; the verdict once every rank's are in."""
        digests, step = event.data.get("digests"), event.data.get("step")
        if not isinstance(digests, dict) or not isinstance(step, int):
            return None
        finding = self.sdc.observe(event.rank, step, digests, world_size)
        if self.sdc.checked_step != step:
            return None  # the check is not complete yet (or was dropped)
        return SdcCheck(step=step, ranks=world_size, finding=finding,
                        last_agreeing_step=self.sdc.last_agreeing_step)

    def observe_record(self, record: JobStep) -> list[Finding]:
        """The detectors' findings for ``record``. During a rerun (``policies/rerun.py``) the
        re-detection of the same anomaly is left to the rerun's verdict, and a reproduced one
        comes back as a finding marked for the data's rollback."""
        self._world = record.world_size
        self._completed = max(self._completed, record.step)
        if self._first_record:
            # The attempt resumed after the step before its first (its checkpoint's, whoever
            # restored it: babysit, the script in stdout mode, a framework): hold its first
            # losses against what the run recorded up to there.
            self._first_record = False
            self._resume_loss = ResumeLoss.start(self.policy.detectors.resume_loss,
                                                 record.step - 1, self.trace.losses(),
                                                 self._restored)
            resume = self._resume
            self._resume_data = ResumeData.start(
                self._batches, self._restored, resume.cursor if resume else None,
                resume.samples if resume else None) if self._batches is not None else None
        batch = self._batches.observe(record) if self._batches is not None else None
        per_rank = {r.rank: r.loss for r in record.ranks if r.loss is not None} \
            if isinstance(record, StepRecord) and record.world_size <= PER_RANK_LIMIT else {}
        seen = Seen(record.cursor, record.loss, record.grad_norm, per_rank)
        self.trace.add(record.step, seen)
        if record.step_time is not None and record.step_time > 0:
            self._pace.append(record.step_time)
        findings = self.pipeline.findings(record, OWN_LOAD_BLIND if self.own_load else ())
        if self._resume_loss is not None and not self._resume_failed:
            failed = self._resume_loss.observe(record.step, record.loss)
            if failed is not None:
                self._resume_failed = True
                findings.append(failed)
        if self._resume_data is not None and \
                (changed := self._resume_data.observe(record.step, batch)) is not None:
            findings.append(changed)
        if self.rerun is None:
            return findings
        first = self.rerun.finding
        findings = [f for f in findings
                    if not (f.incident is first.incident and f.step <= first.step)]
        verdict = self.rerun.observe(record.step, seen)
        if verdict is not None:
            self.rerun = None
            self.verdicts.append(verdict)
            if verdict.reproduced:
                findings.insert(0, verdict.as_finding())
        return findings

    def take_verdicts(self) -> list[Verdict]:
        """The reruns concluded since the last call (the caller journals them)."""
        taken, self.verdicts = self.verdicts, []
        return taken

    def judge(self, finding: Finding, now: float, shelf: Shelf | None) -> Remedy:
        """The policy's answer to ``finding`` (ladders, cooldowns, the rollback's plan, budget).
        ``now`` is wall-clock seconds: cooldowns and budget windows span hours and supervisor
        restarts. ``shelf``: the checkpoints a rollback could go back to (``Recovery.shelf``);
        None when the caller vouches that one exists. A rollback's plan (``rules.judge``, from
        the shelf, this watch's cursor memory and the LR orders in force) is kept for
        ``launch``."""
        pace = statistics.median(self._pace) if self._pace else None
        known = Known(shelf, self.trace.cursors(), self.orders, tuple(self.skips), pace)
        remedy, plan = self.rules.judge(finding, now, known)
        if plan is not None:
            self._planned = plan
        return remedy

    def check(self, now: float) -> list[Finding]:
        """Periodic judgements that need no new telemetry (hangs)."""
        if not self._alive:
            return []
        finding = self.hang.check(now, ranks_alive=self._alive)
        return [finding] if finding is not None else []

    def hang_looming(self, now: float) -> bool:
        """Half-way to a hang suspicion (``HangDetector.looming``)."""
        return bool(self._alive) and self.hang.looming(now, ranks_alive=self._alive)

    def defer_hang(self, finding: Finding, now: float) -> None:
        """The ranks of a suspected hang (``finding``) were found working: suspect again only
        after as long again as the stall has lasted."""
        stalled = finding.evidence.get("stalled", {})
        longest = max((float(v.get("stalled_s", 0.0)) for v in stalled.values()), default=0.0)
        self.hang.defer(now, longest)

    def classify_crash(self, code: int, tails: dict[int, str], step: int,
                       root_rank: int | None = None,
                       exits: dict[int, int] | None = None) -> Finding:
        """A finding for torchrun's non-zero exit ``code``: which rank failed, and how.

        ``exits`` (global rank -> that rank's own exit code, from torchrun's failure summary)
        is the evidence; ``tails`` (each rank's log end) explain it. Each rank is classified
        from its own exit code and log. A rank that failed for a reason of its own (an
        exception, an OOM, a hardware fault, a fatal signal such as SIGSEGV or SIGKILL) is
        named before a peer whose log only shows the broken connection it left, and before a
        rank torchrun merely stopped (SIGTERM). ``root_rank`` (torchrun's "first observed
        failure") only breaks ties: a peer dying of the broken connection is often noticed
        first.

        A rank that never said hello in this attempt (killed in its start-up or its restore, or
        while it waited as a warm standby) trained nothing of it: its death is held against no
        step (never ``deterministic``) and no batch (evidence ``attached`` False:
        ``policies/cause.py``).
        """
        exits = exits or {}
        # The newest step completed this attempt: the loop's own count may lag a tick behind
        # the steps merged in the tick the workers exited, the merged steps behind the
        # just-in-time state's, and where a crash struck must not depend on that
        # (``policies/cause.py`` holds repeats against each other).
        step = max(step, self._completed)
        ranks = sorted(set(tails) | set(exits))

        def unattached(rank: int) -> bool:
            return rank >= 0 and self._attached is not None and rank not in self._attached

        verdicts = {rank: classify(exits.get(rank, code), None, tails.get(rank, ""),
                                   None if unattached(rank) else step or None, self.crashes)
                    for rank in ranks}
        if not verdicts:
            verdicts = {-1: classify(code, None, "", step or None, self.crashes)}

        def weight(rank: int) -> tuple[int, bool, bool, int]:
            return (_blame_order(verdicts[rank]), rank not in exits, rank != root_rank, rank)

        rank = min(verdicts, key=weight)
        verdict = verdicts[rank]
        self.crashes.append(verdict.key())
        finding = verdict.to_finding(step=step, ranks=(rank,) if rank >= 0 else ())
        if exits:
            finding = replace(finding, evidence={**finding.evidence, "rank_exits": {
                str(r): c for r, c in sorted(exits.items())}})
        if unattached(rank):
            finding = replace(finding, evidence={**finding.evidence, ATTACHED: False})
        return finding

    def state_dict(self) -> dict[str, Any]:
        """What a supervisor taking over this run needs to judge as this one would: the rules'
        ladders and budget (so no remedy is spent twice), the crash history (so a deterministic
        crash is still recognised), the skip ranges and LR scale decided so far, and the
        global batches of recent steps (so the next resume's data is still checked)."""
        detectors = self.pipeline.state_dict()["detectors"]
        if self._world > PER_RANK_LIMIT:
            # Its per-rank windows are megabytes at thousands of ranks (27.7 MB a line at
            # 8,192): a taken-over run re-learns them in min_history steps instead.
            detectors.pop("rank_departure", None)
        return {"rules": self.rules.state_dict(),
                "crashes": [[c.signature, c.step] for c in self.crashes],
                "skips": [[r.start, r.end, *(r.samples or ())] for r in self.skips],
                "lr_scale": self.lr_scale,
                "lr_ramp": _ramp_json(self.lr_ramp), "detectors": detectors,
                "sdc": self.sdc.state_dict(),
                "rerun": self.rerun.to_json() if self.rerun is not None else None,
                **({"global_batch": self._batches.state_dict()}
                   if self._batches is not None else {})}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rules.load_state_dict(d["rules"])
        self.crashes = [CrashSignature(str(sig), None if step is None else int(step))
                        for sig, step in d.get("crashes", ())]
        self.skips = [SkipRange(int(r[0]), int(r[1]),
                                (int(r[2]), int(r[3])) if len(r) == 4 else None)
                      for r in d.get("skips", ())]
        self.adopt_lr(d)
        if "sdc" in d:  # the checks that agreed, and each device's first probe
            self.sdc.load_state_dict(d["sdc"])
        if d.get("rerun"):  # a rerun in flight goes on being compared
            self.rerun = Rerun.from_json(d["rerun"])
        if self._batches is not None and d.get("global_batch"):  # the next resume is checked
            self._batches.load_state_dict(d["global_batch"])
        if "detectors" in d:  # the baselines: a taken-over run judges at once, no new warm-up
            self.pipeline.load_state_dict({"detectors": d["detectors"],
                                           "rules": self.rules.state_dict()})

    # -- what the next attempt is told ----------------------------------------------------------

    def adopt_orders(self, directive: dict[str, Any]) -> None:
        """Take the skip ranges and LR orders of a journaled directive: a supervisor taking
        over keeps what the last attempt actually ran with."""
        self.skips = [SkipRange.from_json(r) for r in directive.get("skip", ())]
        self.adopt_lr(directive)

    def adopt_lr(self, orders: dict[str, Any]) -> None:
        """Take the LR orders (``lr_scale``, ``lr_ramp``) of a journaled directive or watch
        state: a supervisor taking over keeps what the last attempt ran with."""
        self.lr_scale = float(orders.get("lr_scale", 1.0))
        ramp = orders.get("lr_ramp")
        self.lr_ramp = LrRamp.from_json(ramp) if isinstance(ramp, dict) else None

    @property
    def orders(self) -> Orders:
        """The LR orders in force (the last attempt's), as the rollback plan takes them."""
        return lr_orders(self.lr_scale, self.lr_ramp)

    def plan(self, remedy: Remedy | None, resume: Resume | None) -> RollbackPlan:
        """What the attempt ``remedy`` causes changes, resuming from ``resume``: the plan the
        rules made for it (``judge``), or for a remedy they did not plan here (one inherited
        from the journal) the same computation from the remedy's own sizes; pure."""
        planned = self._planned
        if remedy is not None and remedy.action is Action.ROLLBACK and planned is not None \
                and planned.finding == remedy.finding:
            return in_directive(planned, resume)
        return plan_relaunch(remedy, resume, self.trace.cursors(), self.lr_scale, self.lr_ramp)

    def launch(self, attempt: int, remedy: Remedy | None, resume: Resume | None,
               checkpoint_every: int | None = None, memory_every: int | None = None,
               lineage: tuple[tuple[str, int | None], ...] = ()) -> tuple[Directive, list[Entry]]:
        """The directive of ``attempt``, which ``remedy`` caused (None: a plain start or a
        takeover), resuming from ``resume`` (the checkpoint ``Recovery`` verified): the
        rollback's plan folded in, skip ranges accumulated over the run. Also the journal
        entry of a change to the LR orders (``lr_scale``: every change is on the record).
        ``checkpoint_every``: the cadence in force (None: the config's); ``memory_every``: the
        memory copies' interval ``auto`` chose, which goes on (None: the config's); ``lineage``:
        the attempt's timeline and its chain (``Recovery.begin``). Call once
        per launch: it records the orders as those in force."""
        plan = self.plan(remedy, resume)
        self._planned = None
        self.rerun = Rerun.start(remedy.finding, self.trace) if remedy is not None \
            and remedy.action is Action.ROLLBACK and asked(remedy.finding) else None
        self._rerun_streams = list(self._streams) if self.rerun is not None else []
        if plan.skip is not None:
            self.skips.append(self.in_samples(plan.skip))
        ramp, kept = plan.lr_ramp, self.lr_ramp
        if ramp is not None and kept is not None and ramp == kept.bare():
            ramp = kept  # the orders in force, as first given (in samples if they were)
        elif ramp is not None:
            ramp = self.ramp_in_samples(ramp)
        changes: list[Entry] = []
        if (plan.lr_scale, _bare(ramp)) != (self.lr_scale, _bare(kept)):
            changes.append(("lr_scale", {"lr_scale": plan.lr_scale,
                                         "lr_ramp": _ramp_json(ramp), "base": plan.base,
                                         "was": self.lr_scale, "summary": plan.describe()}))
        self.lr_scale, self.lr_ramp = plan.lr_scale, ramp
        guard: dict[str, Any] = {}
        if self.policy.incidents.grad_spike.ladder[0] is Action.SKIP_STEP:
            guard = self.policy.detectors.grad_norm.model_dump()
        directive = Directive(
            attempt=attempt, resume=plan.resume, skip=merge_skips(self.skips),
            lr_scale=self.lr_scale, lr_ramp=self.lr_ramp, checkpoint_dir=self._checkpoint_dir,
            checkpoint_every=self.checkpoint_every if checkpoint_every is None
            else checkpoint_every, checkpoint_async=self._checkpoint_async,
            grad_guard=guard, sdc_every=self.sdc_every, reshard=self.reshard,
            save_at=plan.save_at,
            memory={"every": memory_every} if memory_every is not None else {},
            lineage=lineage,
        )
        self._rerun_from = None
        if self.rerun is not None:
            self._rerun_from = plan.resume.step if plan.resume is not None else 0
        return directive, changes

    def replayed(self, remedy: Remedy | None) -> tuple[int, int] | None:
        """For the data's rollback after a rerun that reproduced its anomaly: the step the
        rerun resumed after and the cursor the rollback skips from (``Recovery.resume_for``:
        what the rerun saved in between is the rollback's to resume from); else None."""
        planned = self._planned
        if remedy is None or remedy.action is not Action.ROLLBACK or self._rerun_from is None \
                or remedy.finding.evidence.get("rerun") != REPRODUCED or planned is None \
                or planned.finding != remedy.finding or planned.skip is None:
            return None
        return self._rerun_from, planned.skip.start


@dataclass(frozen=True, slots=True)
class _Stream:
    """One attempt's data stream (rank 0's ``stream`` event): global batch ``cursor`` began
    at sample ``samples``, and each held ``global_batch``."""

    cursor: int
    samples: int
    global_batch: int


def _ramp_json(ramp: LrRamp | None) -> dict[str, Any] | None:
    if ramp is None:
        return None
    return {"cut": ramp.cut, "start": ramp.start, "end": ramp.end, "to": ramp.to,
            **({"samples": list(ramp.samples)} if ramp.samples is not None else {})}


def _bare(ramp: LrRamp | None) -> LrRamp | None:
    return None if ramp is None else ramp.bare()
