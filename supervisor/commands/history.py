"""A run directory, read: the journal digested into attempts, incidents and checkpoints, and the
status snapshot that ``babysit status`` prints and ``babysit report`` draws.

Nothing here talks to the supervisor: the journal (``events.jsonl``) is the source of truth, the
tail of ``metrics.jsonl`` gives the latest step and speed, and ``<checkpoint root>`` (the
directive's ``checkpoint_dir``, else ``RUN_DIR/checkpoints``) gives checkpoints and verdicts. The
metrics file is read backwards from its end, so a million-step run answers as fast as a short one.

``snapshot()`` returns one object with these keys (``babysit status --json`` prints it; stable;
absent values are ``null``, never missing; non-finite floats are the strings ``"nan"``/``"inf"``
as in the journal)::

    run_dir, journal, metrics   paths (str)
    name                        the run's name (str | null)
    state                       the supervisor's last state ("starting", "running", "intervening",
                                "relaunching", "succeeded", "failed", "stopped", ...), or
                                "abandoned": no run_finished and the supervisor process is gone
    live                        the supervisor process is alive (bool)
    reason, exit_code           why the last state was entered; the run's exit code once finished
    verdict                     a failed run's word to its scheduler: {verdict: requeue | stop,
                                why, exclude_hosts} (``run.exit_codes``), or null
    supervisor_pid              pid from run_started (int | null)
    started, finished           Unix seconds (float | null)
    elapsed_s                   started -> finished, or -> now while live
    last_update                 Unix seconds of the newest metrics row or journal entry
    attempt, attempts           the current attempt number; how many attempts were launched
    step, loss                  the newest metrics row's step and mean loss
    steps_per_s, tokens_per_s   over the newest (up to) 50 rows of the current attempt
    mfu                         median model FLOPs utilisation (0..1) over those rows; null unless
                                the script gave tokens, FLOPs per token and peak FLOP/s
    loss_spread                 the newest row's per-rank loss: {min, min_rank, median, max,
                                max_rank}, or null
    sdc                         silent-data-corruption checks, or null when none ran: {checks,
                                last_agreeing_step, disagreements: the newest 5 {step, ranks}}
    cadence                     the newest checkpoint cadence advice (the journal's
                                cadence_advice fields, with "summary"), or null; plus
                                "adopted_every": the interval auto-adoption set last, or null
    nodes                       multi-node runs (the leader's journal), else null: {attempt,
                                nodes: {node rank: host} of the newest launch, lost: the newest
                                5 {time, node, host, why}}
    slurm                       a run under srun: {job_id, took: {key: "value (VARIABLE)"} of
                                the newest launch, and once its session ended, action:
                                "requeue" | "cancel" | null (left to end), why, error}
                                (``run.slurm_job``); else null
    reruns                      whose fault each rerun spike or NaN was (``rerun`` entries):
                                the newest 5 {time, step, verdict: "reproduced" (the data's,
                                skipped), "transient" (the machine's, nothing skipped) or
                                "undecided" (it could not replay the same samples: taken as
                                the data's), moved_first: ranks, summary}, oldest first
    incident_count              findings acted on (action != "ignore")
    ignored_findings            findings not acted on: ignored by the policy (cooldowns, below
                                threshold) or set aside while the workers were being replaced
    incidents                   the newest 10 acted-on findings, oldest first: {time, attempt,
                                step, onset_step, incident, severity, ranks, action, reason,
                                message, dir (its incident folder, or null)}
    attempt_history             every launch: {attempt, time, resume_step (babysit's checkpoint,
                                or in stdout mode the script's own put back), resume_samples
                                (the samples consumed there, ElasticSampler), resume_note, skip:
                                [[start, end]] (data-cursor batches; [start, end, first, last
                                + 1] with the samples of the stream, ElasticSampler), lr_scale,
                                cause: the
                                incident that made babysit launch it, or null}
    checkpoint_dir              the checkpoint root looked at (str)
    checkpoints                 [{step, cursor, verdict, reason, path, origin}], oldest first
                                (origin: periodic or just_in_time)
    memory_copies               the memory tier as the journal tells it: {every (steps, the
                                newest plan or cost-model choice), copies (committed), newest
                                (its step), off (why none are made, or null), failed,
                                first_failure ({step, rank, error} of the first copy that
                                failed, or null)}; null when the run never spoke of it
    goodput                     the goodput ledger (``babysit.supervisor.services.goodput``):
                                {wall_s, goodput (0..1, productive / wall), seconds: {category:
                                s} for productive, startup, checkpoint, restore, detection,
                                lost, relaunch, backoff, down, straggler, shutdown, other (they
                                sum to wall_s), attempts: [{attempt, wall_s, seconds}],
                                source: "files" (computed from the journal and every metrics
                                row; a live run's counts up to now) or "journal" (a metrics file
                                over 16 MiB: the ledger the supervisor journaled at its end)};
                                null for a metrics file over 16 MiB with no journaled ledger
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from babysit.supervisor.commands.metrics_file import (
    METRICS,
    finite_float,
    median_mfu,
    rates,
    read_metrics,
    read_metrics_tail,
    row_loss_spread,
)
from babysit.supervisor.run import journal as journal_mod
from babysit.supervisor.services import goodput as goodput_mod

EVENTS = "events.jsonl"
RECENT_INCIDENTS = 10


class NotARunDir(Exception):
    """RUN_DIR has no journal. The message is one paragraph meant for the user."""


# -- the journal, digested -------------------------------------------------------------------------


@dataclass
class IncidentRecord:
    """A finding from the journal with the policy's answer to it."""

    time: float
    attempt: int
    step: int | None
    onset_step: int | None
    incident: str
    severity: str
    ranks: list[int]
    action: str
    reason: str
    message: str
    dir: str | None = None
    """The incident folder (logs, stack dumps) babysit wrote for it, when it wrote one."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Attempt:
    """One launch: what its ranks were told (resume, skips in cursor space, LR scale) and why."""

    attempt: int
    time: float
    resume_step: int | None
    skip: list[tuple[int, ...]]
    """(start, end) data-cursor batches, and (first, end) samples when given in samples."""
    lr_scale: float
    cause: IncidentRecord | None
    resume_note: str | None = None
    """Why it resumed where it did, from the journal's resume entry (e.g. no usable checkpoint)."""
    lr_ramp: dict[str, Any] | None = None
    """How a rollback's LR cut wears off: ``start``/``end`` data cursors and the scale ``to``."""
    resume_samples: int | None = None
    """The samples of the data stream its checkpoint recorded (``ElasticSampler``), if any."""

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "time": self.time, "resume_step": self.resume_step,
                "resume_samples": self.resume_samples,
                "resume_note": self.resume_note, "skip": [list(s) for s in self.skip],
                "lr_scale": self.lr_scale, "lr_ramp": self.lr_ramp,
                "cause": self.cause.to_json() if self.cause else None}


@dataclass
class History:
    """What the journal says about a run. Build with ``History.read``; unknown events are kept in
    ``events`` and otherwise ignored, so newer journals stay readable."""

    run_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None
    pid: int | None = None
    started: float | None = None
    finished: dict[str, Any] | None = None
    last_state: dict[str, Any] | None = None
    attempts: list[Attempt] = field(default_factory=list)
    incidents: list[IncidentRecord] = field(default_factory=list)
    ignored: list[IncidentRecord] = field(default_factory=list)
    checkpoint_dir: Path | None = None

    @classmethod
    def read(cls, run_dir: Path) -> History:
        """Digest ``run_dir/events.jsonl``. Raises NotARunDir when there is no journal."""
        path = run_dir / EVENTS
        if not path.is_file():
            raise NotARunDir(_not_a_run_dir(run_dir))
        h = cls(run_dir)
        pending_cause: IncidentRecord | None = None
        resume_note: str | None = None
        folders: dict[Any, str] = {}  # incident -> the folder just written, for its finding
        for e in journal_mod.read(path):
            if not isinstance(e, dict):
                continue
            h.events.append(e)
            kind = e.get("event")
            if kind == "run_started":
                # A restarted supervisor appends to the same journal: the newest start counts.
                h.name = e.get("name") or h.name
                h.pid = e.get("pid") if isinstance(e.get("pid"), int) else None
                h.started = h.started if h.started is not None else finite_float(e.get("time"))
                h.finished = None
            elif kind == "run_finished":
                h.finished = e
            elif kind == "state":
                h.last_state = e
            elif kind == "finding_set_aside":
                # Arrived while workers were being replaced: journaled, never judged.
                h.ignored.append(_incident(e, set_aside=True))
            elif kind == "incident" and e.get("dir"):
                folders[e.get("incident")] = str(e["dir"])  # its finding is the next entry
            elif kind == "resume":
                resume_note = e.get("summary") or e.get("reason") or (
                    f"checkpoint at step {e.get('checkpoint_step')} ({e.get('verdict')})"
                    if e.get("from") else None)
            elif kind == "script_checkpoint_restored" and e.get("from"):
                # Stdout mode: babysit has no checkpoint of its own; the script resumes from its
                # own, which babysit put back (the resume entry before it says "from scratch").
                resume_note = (f"the script's own checkpoint at step {e.get('checkpoint_step')}"
                               " (its copy, put back)")
            elif kind == "finding":
                inc = _incident(e)
                inc.dir = folders.pop(inc.incident, None)
                if inc.action == "ignore":
                    h.ignored.append(inc)
                else:
                    h.incidents.append(inc)
                    if inc.action in ("relaunch", "rollback", "stop") or inc.incident == "crash":
                        pending_cause = inc
            elif kind == "launch":
                d = _dict(e.get("directive"))
                # The directive's resume (its own schema: ``step``), or the script's own
                # checkpoint that stdout mode put back.
                resume = _dict(d.get("resume"))
                script = _dict(e.get("script_resume"))
                skip = [(int(s["start"]), int(s["end"]), *map(int, s.get("samples") or ()))
                        for s in d.get("skip") or ()
                        if isinstance(s, dict) and "start" in s and "end" in s]
                h.attempts.append(Attempt(
                    attempt=_int(d.get("attempt"), _int(e.get("attempt"), len(h.attempts))),
                    time=finite_float(e.get("time")) or 0.0,
                    resume_step=resume.get("step") if resume
                    else script.get("checkpoint_step") if script else None,
                    skip=skip, lr_scale=finite_float(d.get("lr_scale")) or 1.0,
                    cause=pending_cause if h.attempts else None, resume_note=resume_note,
                    lr_ramp=_dict(d.get("lr_ramp")) or None,
                    resume_samples=_optional_int(resume.get("samples")) if resume else None))
                pending_cause, resume_note = None, None
                if d.get("checkpoint_dir"):
                    h.checkpoint_dir = Path(str(d["checkpoint_dir"]))
        return h

    @property
    def journal(self) -> Path:
        return self.run_dir / EVENTS

    @property
    def checkpoint_root(self) -> Path:
        return self.checkpoint_dir or self.run_dir / "checkpoints"

    def live(self) -> bool:
        """The supervisor that wrote the newest run_started still runs (and has not finished)."""
        return self.finished is None and self.pid is not None and _alive(self.pid, self.started)


def _not_a_run_dir(run_dir: Path) -> str:
    if not run_dir.exists():
        what = "does not exist"
    elif not run_dir.is_dir():
        what = "is a file, not a folder"
    else:
        what = f"is not a babysit run directory: there is no {EVENTS} in it"
    return (f"{run_dir} {what}. Pass the folder that 'babysit run' printed when it started (by "
            f"default runs/<name>-<date>-<time> under the folder babysit ran in, or the run_dir "
            f"of its config or --run-dir); it holds {EVENTS} and {METRICS}.")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _incident(e: dict[str, Any], set_aside: bool = False) -> IncidentRecord:
    f, r = _dict(e.get("finding")), _dict(e.get("remedy"))
    if set_aside:
        r = {"action": "set_aside", "reason": f"set aside while {e.get('state', 'intervening')}"}
    step = f.get("step", e.get("step"))
    return IncidentRecord(
        time=finite_float(e.get("time")) or 0.0, attempt=_int(e.get("attempt"), 0),
        step=step if isinstance(step, int) else None,
        onset_step=f.get("onset_step") if isinstance(f.get("onset_step"), int) else None,
        incident=str(f.get("incident", "?")), severity=str(f.get("severity", "?")),
        ranks=[x for x in f.get("ranks") or () if isinstance(x, int)],
        action=str(r.get("action", "?")), reason=str(r.get("reason", "")),
        message=str(f.get("message", "")))


def _alive(pid: int, started: float | None) -> bool:
    import psutil

    try:
        created = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    # A recycled pid belongs to a process younger than the run.
    return started is None or created <= started + 1.0


def checkpoints(h: History) -> list[dict[str, Any]]:
    """Committed checkpoints and verdicts under the run's checkpoint root, oldest first.

    Falls back to the journal's checkpoint_saved/checkpoint_verdict events when the root is gone
    (another machine, retention) or holds none (stdout mode's copies of the script's own are
    elsewhere; the root may hold only the run's lineage); an unreadable root is reported,
    never raised.
    """
    root = h.checkpoint_root
    if root.is_dir():
        from babysit.checkpoints.catalog import Catalog

        try:
            listed = [{"step": c.step, "cursor": c.cursor, "verdict": c.verdict.value,
                       "reason": c.reason, "path": str(c.path), "origin": c.manifest.origin}
                      for c in Catalog(root).checkpoints()]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [{"step": None, "cursor": None, "verdict": "unreadable",
                     "reason": f"{type(exc).__name__}: {exc}", "path": str(root)}]
        if listed:
            return listed
    found: dict[int, dict[str, Any]] = {}
    for e in h.events:
        data = _dict(e.get("data"))
        step = journal_mod.checkpoint_step(e)
        if step is None:
            continue
        if e.get("event") == "checkpoint_saved":
            copy = data.get("source") == "output"  # stdout mode's copy of the script's own
            found[step] = {"step": step, "cursor": data.get("cursor", e.get("cursor")),
                           "verdict": "copy" if copy else "pending",
                           "reason": "a copy of the script's own checkpoint (stdout mode): put "
                                     "back on a relaunch, never judged by probation"
                           if copy else None,
                           "path": data.get("path", e.get("path"))}
        elif e.get("event") == "just_in_time" and e.get("outcome") == "saved":
            found[step] = {"step": step, "cursor": e.get("cursor"), "verdict": "pending",
                           "reason": None, "path": e.get("path"), "origin": "just_in_time"}
        elif e.get("event") == "checkpoint_verdict" and step in found:
            found[step]["verdict"] = str(e.get("verdict"))
            found[step]["reason"] = e.get("reason")
    return [found[s] for s in sorted(found)]


def memory_copies(h: History) -> dict[str, Any] | None:
    """The memory tier as the journal tells it (``memory_copy_plan``, ``memory_cadence``, each
    committed ``memory_copy``, ``memory_copy_off``, ``memory_copy_failed``); None when the run
    never spoke of it (copies asked for nowhere, stdout mode, a journal from before them)."""
    said = {"memory_copy", "memory_copy_plan", "memory_cadence", "memory_copy_off",
            "memory_copy_failed"}
    entries = [e for e in h.events if e.get("event") in said]
    if not entries:
        return None
    out: dict[str, Any] = {"every": None, "copies": 0, "newest": None, "off": None, "failed": 0,
                           "first_failure": None}
    for e in entries:
        kind = e["event"]
        if kind == "memory_copy":
            out["copies"] += 1
            out["newest"] = journal_mod.checkpoint_step(e)
        elif kind == "memory_copy_plan":
            out["every"], out["off"] = _dict(e.get("data")).get("every"), None
        elif kind == "memory_cadence":
            out["every"] = e.get("every_steps")
        elif kind == "memory_copy_off":
            out["off"] = e.get("why") or e.get("summary")
        else:
            out["failed"] += 1
            if out["first_failure"] is None:
                data = _dict(e.get("data"))
                out["first_failure"] = {"step": data.get("step"), "rank": e.get("rank"),
                                        "error": data.get("error")}
    return out


def sdc_disagreement(entry: dict[str, Any]) -> bool:
    """An ``sdc_check`` entry where ranks disagreed and were named (a check that repeats an
    already named disagreement, ``repeat``, is not a new one)."""
    return entry.get("agree") is False and not entry.get("repeat")


def sdc_checks(h: History) -> dict[str, Any] | None:
    """What the journal's ``sdc_check`` entries say: how many, and where ranks disagreed.
    ``last_agreeing_step`` is the newest check's, which forgets agreements a rollback
    abandoned."""
    checks = [e for e in h.events if e.get("event") == "sdc_check"]
    if not checks:
        return None
    bad = [{"step": e.get("checked_step"), "ranks": e.get("disagreeing") or []}
           for e in checks if sdc_disagreement(e)]
    return {"checks": len(checks), "last_agreeing_step": checks[-1].get("last_agreeing_step"),
            "disagreements": bad[-5:]}


def reruns(h: History) -> list[dict[str, Any]]:
    """The newest verdicts of reruns (``policies/rerun.py``): whose fault each spike was."""
    return [{"time": e.get("time"), "step": e.get("step"), "verdict": e.get("verdict"),
             "moved_first": e.get("moved_first") or [], "summary": e.get("summary", "")}
            for e in h.events if e.get("event") == "rerun"][-5:]


def cadence(h: History) -> dict[str, Any] | None:
    """The newest cadence advice and the newest interval auto-adoption set."""
    advice = next((e for e in reversed(h.events) if e.get("event") == "cadence_advice"), None)
    if advice is None:
        return None
    keep = {k: v for k, v in advice.items() if k not in ("event", "time", "attempt", "step")}
    adopted = next((e.get("new_every") for e in reversed(h.events)
                    if e.get("event") == "cadence_adopted"), None)
    return {**keep, "adopted_every": adopted}


def nodes(h: History) -> dict[str, Any] | None:
    """Which nodes the newest attempt of a multi-node run has, which wait as its spares, which
    were lost, and which were evicted (and why)."""
    launch = next((e for e in reversed(h.events)
                   if e.get("event") == "launch" and isinstance(e.get("hosts"), dict)), None)
    if launch is None:
        return None
    lost = [{"time": e.get("time"), "node": e.get("node"), "host": e.get("host"),
             "why": e.get("why")} for e in h.events if e.get("event") == "node_lost"]
    evicted = [{"time": e.get("time"), "node": e.get("node"), "host": e.get("host"),
                "why": e.get("why")} for e in h.events if e.get("event") == "node_evicted"]
    spares = launch.get("spares") if isinstance(launch.get("spares"), dict) else {}
    return {"attempt": launch.get("attempt"), "nodes": launch["hosts"], "spares": spares,
            "lost": lost[-5:], "evicted": evicted}


def slurm(h: History) -> dict[str, Any] | None:
    """The Slurm job a run under ``srun`` ran in, what it took from the step, and what the end
    of its newest session did to the job."""
    launch = next((e for e in reversed(h.events)
                   if e.get("event") == "launch" and isinstance(e.get("slurm"), dict)), None)
    if launch is None:
        return None
    took = launch["slurm"]
    ending = next((e for e in reversed(h.events) if e.get("event") == "slurm_job"), None)
    if ending is not None and ending.get("time", 0) < launch.get("time", 0):
        ending = None  # an earlier session's
    return {"job_id": took.get("job_id"), "took": took.get("took", {}),
            **{k: ending.get(k) if ending else None for k in ("action", "why", "error")}}


LEDGER_MAX_BYTES = 16 << 20
"""Above this size (about 27k steps of a 2-rank run; reading that much takes 0.6 s here),
``status`` does not read the whole metrics file for the ledger; it shows the one the supervisor
journaled when the run ended."""


def goodput(h: History, now: float | None = None,
            max_bytes: int | None = LEDGER_MAX_BYTES) -> dict[str, Any] | None:
    """The run's goodput ledger (``Goodput.to_json()`` plus ``source``): from its journal and
    every metrics row (``"files"``; ``now``: a live run's time counts up to it), or, for a
    metrics file above ``max_bytes`` (None: no limit), the newest ``goodput`` entry the
    supervisor journaled at the end of its session (``"journal"``); None when neither is at
    hand."""
    path = h.run_dir / METRICS
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    if max_bytes is None or size <= max_bytes:
        led = goodput_mod.ledger(h.events, read_metrics(path), now)
        return {**led.to_json(), "source": "files"}
    entry = next((e for e in reversed(h.events) if e.get("event") == "goodput"), None)
    if entry is None:
        return None
    return {"wall_s": entry.get("wall_s"), "goodput": entry.get("goodput"),
            "seconds": entry.get("seconds"), "attempts": entry.get("attempts"),
            "source": "journal"}


def snapshot(run_dir: str | Path, now: float | None = None) -> dict[str, Any]:
    """The status object documented in the module docstring. Raises NotARunDir."""
    now = time.time() if now is None else now
    h = History.read(Path(run_dir))
    tail = read_metrics_tail(h.run_dir / METRICS)
    live = h.live()
    fin = h.finished
    if fin is not None:
        state, reason, code = str(fin.get("state")), fin.get("reason"), fin.get("exit_code")
    elif live:
        st = h.last_state or {}
        state, reason, code = str(st.get("new", "starting")), st.get("reason"), None
    else:
        state, code = "abandoned", None
        reason = (f"no run_finished in the journal and supervisor pid {h.pid} is gone (killed, or "
                  f"this is another machine); last state: "
                  f"{(h.last_state or {}).get('new', 'none')}")
    last = tail[-1] if tail else None
    newest_event = finite_float(h.events[-1].get("time")) if h.events else None
    times = [t for t in (finite_float(last and last.get("time")), newest_event) if t is not None]
    finished_at = finite_float(fin.get("time")) if fin else None
    end = finished_at if finished_at is not None else (now if live else max(times, default=None))
    steps_per_s, tokens_per_s = rates(tail)
    step = last["step"] if last else next(
        (e["step"] for e in reversed(h.events) if isinstance(e.get("step"), int)), None)
    attempt = h.attempts[-1].attempt if h.attempts else (h.events[-1].get("attempt")
                                                         if h.events else None)
    return {
        "run_dir": str(h.run_dir), "journal": str(h.journal), "metrics": str(h.run_dir / METRICS),
        "name": h.name, "state": state, "live": live, "reason": reason, "exit_code": code,
        "verdict": ({k: fin.get(k) for k in ("verdict", "why", "exclude_hosts")}
                    if fin is not None and fin.get("verdict") else None),
        "supervisor_pid": h.pid, "started": h.started, "finished": finished_at,
        "elapsed_s": end - h.started if end is not None and h.started is not None else None,
        "last_update": max(times, default=None),
        "attempt": attempt, "attempts": len(h.attempts),
        "step": step, "loss": last.get("loss") if last else None,
        "steps_per_s": steps_per_s, "tokens_per_s": tokens_per_s, "mfu": median_mfu(tail),
        "loss_spread": row_loss_spread(last),
        "sdc": sdc_checks(h), "cadence": cadence(h), "nodes": nodes(h), "reruns": reruns(h),
        "slurm": slurm(h),
        "incident_count": len(h.incidents), "ignored_findings": len(h.ignored),
        "incidents": [i.to_json() for i in h.incidents[-RECENT_INCIDENTS:]],
        "attempt_history": [a.to_json() for a in h.attempts],
        "checkpoint_dir": str(h.checkpoint_root), "checkpoints": checkpoints(h),
        "memory_copies": memory_copies(h),
        "goodput": goodput(h, now if live else None),
    }


def follower_journal(run_dir: Path) -> dict[str, Any] | None:
    """What a follower node's folder (``RUN_DIR/nodes/<R>``) says of itself, or None when
    ``run_dir`` is not one: which node, how it ended, and where the leader's record is."""
    path = run_dir / EVENTS
    if not path.is_file():
        return None
    entries = [e for e in journal_mod.read(path) if isinstance(e, dict)]
    started = next((e for e in entries if e.get("event") == "follower_started"), None)
    if started is None:
        return None
    finished = next((e for e in reversed(entries) if e.get("event") == "follower_finished"),
                    None)
    return {"node": started.get("node"), "host": started.get("host"),
            "leader": started.get("leader"), "record": str(run_dir.resolve().parent.parent),
            "exit_code": finished.get("exit_code") if finished else None}
