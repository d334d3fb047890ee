"""``babysit status RUN_DIR``: where a run stands, live or finished, read from its files alone.

Nothing here talks to the supervisor: the journal (``events.jsonl``) is the source of truth, the
tail of ``metrics.jsonl`` gives the latest step and speed, and ``<checkpoint root>`` (the
directive's ``checkpoint_dir``, else ``RUN_DIR/checkpoints``) gives checkpoints and verdicts. The
metrics file is read backwards from its end, so a million-step run answers as fast as a short one.

``--json`` prints one object with these keys (stable; absent values are ``null``, never missing;
non-finite floats are the strings ``"nan"``/``"inf"`` as in the journal)::

    run_dir, journal, metrics   paths (str)
    name                        the run's name (str | null)
    state                       the supervisor's last state ("starting", "running", "intervening",
                                "relaunching", "succeeded", "failed", "stopped", ...), or
                                "abandoned": no run_finished and the supervisor process is gone
    live                        the supervisor process is alive (bool)
    reason, exit_code           why the last state was entered; the run's exit code once finished
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
    incident_count              findings acted on (action != "ignore")
    ignored_findings            findings not acted on: ignored by the policy (cooldowns, below
                                threshold) or set aside while the workers were being replaced
    incidents                   the newest 10 acted-on findings, oldest first: {time, attempt,
                                step, onset_step, incident, severity, ranks, action, reason,
                                message, dir (its incident folder, or null)}
    attempt_history             every launch: {attempt, time, resume_step, resume_note, skip:
                                [[start, end]] (data-cursor batches), lr_scale, cause: the
                                incident that made babysit launch it, or null}
    checkpoint_dir              the checkpoint root looked at (str)
    checkpoints                 [{step, cursor, verdict, reason, path}], oldest first
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from babysit.supervisor.run import journal as journal_mod

EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
TAIL_ROWS = 50
RECENT_INCIDENTS = 10
# Metrics keys whose values may be written as "nan"/"inf" strings (see journal.json_safe).
_FLOAT_KEYS = ("loss", "loss_min", "loss_median", "loss_max", "grad_norm", "lr", "tokens",
               "step_time", "tokens_per_s", "mfu")
_LIST_KEYS = ("loss_per_rank", "step_time_per_rank", "data_wait_per_rank")


class NotARunDir(Exception):
    """RUN_DIR has no journal. The message is one paragraph meant for the user."""


# -- reading --------------------------------------------------------------------------------------


def to_float(value: Any) -> float | None:
    """A metrics or journal number as a float: "nan"/"inf" strings revived, anything else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def parse_metrics_line(line: str | bytes) -> dict[str, Any] | None:
    """One ``metrics.jsonl`` line with floats revived, or None for a torn or foreign line."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return None
    for key in _FLOAT_KEYS:
        if key in row:
            row[key] = to_float(row[key])
    for key in _LIST_KEYS:
        if isinstance(row.get(key), list):
            row[key] = [to_float(v) for v in row[key]]
    return row


def read_metrics_tail(path: Path, rows: int = TAIL_ROWS,
                      block: int = 1 << 16) -> list[dict[str, Any]]:
    """The last ``rows`` parseable rows of a metrics file, oldest first; [] if it is missing.

    Reads backwards from the end in ``block``-byte chunks: cost is independent of the file's size.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the seek loop reads better unnested)
    except FileNotFoundError:
        return []
    with f:
        pos = f.seek(0, os.SEEK_END)
        buf = b""
        # rows + 2 newlines: the first chunk line may be partial and the last may be torn.
        while pos > 0 and buf.count(b"\n") < rows + 2:
            size = min(block, pos)
            pos -= size
            f.seek(pos)
            buf = f.read(size) + buf
    lines = buf.split(b"\n")
    if pos > 0:
        lines = lines[1:]  # starts mid-line
    parsed = [r for r in (parse_metrics_line(x) for x in lines if x.strip()) if r is not None]
    return parsed[-rows:]


def read_metrics(path: Path) -> Iterable[dict[str, Any]]:
    """Every parseable metrics row in file order (the report's full read)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                row = parse_metrics_line(line)
                if row is not None:
                    yield row
    except FileNotFoundError:
        return


# -- the journal, digested -------------------------------------------------------------------------


@dataclass
class Incident:
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
    skip: list[tuple[int, int]]
    lr_scale: float
    cause: Incident | None
    resume_note: str | None = None
    """Why it resumed where it did, from the journal's resume entry (e.g. no usable checkpoint)."""

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "time": self.time, "resume_step": self.resume_step,
                "resume_note": self.resume_note, "skip": [list(s) for s in self.skip],
                "lr_scale": self.lr_scale, "cause": self.cause.to_json() if self.cause else None}


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
    incidents: list[Incident] = field(default_factory=list)
    ignored: list[Incident] = field(default_factory=list)
    checkpoint_dir: Path | None = None

    @classmethod
    def read(cls, run_dir: Path) -> History:
        """Digest ``run_dir/events.jsonl``. Raises NotARunDir when there is no journal."""
        path = run_dir / EVENTS
        if not path.is_file():
            raise NotARunDir(_not_a_run_dir(run_dir))
        h = cls(run_dir)
        pending_cause: Incident | None = None
        resume_note: str | None = None
        folders: dict[tuple[Any, Any], str] = {}  # (step, incident) -> folder, until its finding
        for e in journal_mod.read(path):
            if not isinstance(e, dict):
                continue
            h.events.append(e)
            kind = e.get("event")
            if kind == "run_started":
                # A restarted supervisor appends to the same journal: the newest start counts.
                h.name = e.get("name") or h.name
                h.pid = e.get("pid") if isinstance(e.get("pid"), int) else None
                h.started = h.started if h.started is not None else _num(e.get("time"))
                h.finished = None
            elif kind == "run_finished":
                h.finished = e
            elif kind == "state":
                h.last_state = e
            elif kind == "finding_set_aside":
                # Arrived while workers were being replaced: journaled, never judged.
                h.ignored.append(_incident(e, set_aside=True))
            elif kind == "incident" and e.get("dir"):
                folders[(e.get("step"), e.get("incident"))] = str(e["dir"])
            elif kind == "resume":
                resume_note = e.get("reason") or (
                    f"checkpoint at step {e.get('checkpoint_step')} ({e.get('verdict')})"
                    if e.get("from") else None)
            elif kind == "finding":
                inc = _incident(e)
                inc.dir = folders.pop((inc.step, inc.incident), None)
                if inc.action == "ignore":
                    h.ignored.append(inc)
                else:
                    h.incidents.append(inc)
                    if inc.action in ("relaunch", "rollback", "stop") or inc.incident == "crash":
                        pending_cause = inc
            elif kind == "launch":
                d = _dict(e.get("directive"))
                resume = _dict(d.get("resume"))
                skip = [(int(s["start"]), int(s["end"])) for s in d.get("skip") or ()
                        if isinstance(s, dict) and "start" in s and "end" in s]
                h.attempts.append(Attempt(
                    attempt=_int(d.get("attempt"), _int(e.get("attempt"), len(h.attempts))),
                    time=_num(e.get("time")) or 0.0,
                    resume_step=resume.get("step") if resume else None,
                    skip=skip, lr_scale=_num(d.get("lr_scale")) or 1.0,
                    cause=pending_cause if h.attempts else None, resume_note=resume_note))
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


def _num(value: Any) -> float | None:
    v = to_float(value)
    return v if v is not None and math.isfinite(v) else None


def _incident(e: dict[str, Any], set_aside: bool = False) -> Incident:
    f, r = _dict(e.get("finding")), _dict(e.get("remedy"))
    if set_aside:
        r = {"action": "set_aside", "reason": f"set aside while {e.get('state', 'intervening')}"}
    step = f.get("step", e.get("step"))
    return Incident(
        time=_num(e.get("time")) or 0.0, attempt=_int(e.get("attempt"), 0),
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
    (another machine, retention); an unreadable root is reported, never raised.
    """
    root = h.checkpoint_root
    if root.is_dir():
        from babysit.checkpoints.catalog import Catalog

        try:
            return [{"step": c.step, "cursor": c.cursor, "verdict": c.verdict.value,
                     "reason": c.reason, "path": str(c.path)} for c in Catalog(root).checkpoints()]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [{"step": None, "cursor": None, "verdict": "unreadable",
                     "reason": f"{type(exc).__name__}: {exc}", "path": str(root)}]
    found: dict[int, dict[str, Any]] = {}
    for e in h.events:
        data = _dict(e.get("data"))
        step = e.get("checkpoint_step", e.get("step"))
        if not isinstance(step, int):
            continue
        if e.get("event") == "checkpoint_saved":
            found[step] = {"step": step, "cursor": data.get("cursor", e.get("cursor")),
                           "verdict": "pending", "reason": None,
                           "path": data.get("path", e.get("path"))}
        elif e.get("event") == "checkpoint_verdict" and step in found:
            found[step]["verdict"] = str(e.get("verdict"))
            found[step]["reason"] = e.get("reason")
    return [found[s] for s in sorted(found)]


# -- the snapshot ---------------------------------------------------------------------------------


def rates(rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Steps/s and tokens/s over ``rows`` of the newest attempt among them (None: too few)."""
    if not rows:
        return None, None
    same = [r for r in rows if r.get("attempt") == rows[-1].get("attempt")]
    t0, t1 = _num(same[0].get("time")), _num(same[-1].get("time"))
    if len(same) < 2 or t0 is None or t1 is None or t1 <= t0:
        return None, None
    steps = (same[-1]["step"] - same[0]["step"]) / (t1 - t0)
    tokens = [r.get("tokens") for r in same[1:]]
    per_s = None
    if all(isinstance(t, float) and math.isfinite(t) for t in tokens):
        per_s = sum(t for t in tokens if t is not None) / (t1 - t0)
    return steps, per_s


def median_mfu(rows: list[dict[str, Any]]) -> float | None:
    """Median MFU over ``rows`` of the newest attempt among them (None when none reported)."""
    if not rows:
        return None
    values = sorted(v for r in rows if r.get("attempt") == rows[-1].get("attempt")
                    and (v := _num(r.get("mfu"))) is not None)
    return values[len(values) // 2] if values else None


def row_loss_spread(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """The per-rank loss summary of one metrics row (as ``rank_departure.loss_spread`` made
    it): the rank whose loss departs shows as the min or max rank, far from the median."""
    if not row or _num(row.get("loss_median")) is None:
        return None
    return {"min": _num(row.get("loss_min")), "min_rank": row.get("loss_min_rank"),
            "median": _num(row.get("loss_median")), "max": _num(row.get("loss_max")),
            "max_rank": row.get("loss_max_rank")}


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
    bad = [{"step": e.get("step"), "ranks": e.get("disagreeing") or []}
           for e in checks if sdc_disagreement(e)]
    return {"checks": len(checks), "last_agreeing_step": checks[-1].get("last_agreeing_step"),
            "disagreements": bad[-5:]}


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
    """Which nodes the newest attempt of a multi-node run has, and which were lost."""
    launch = next((e for e in reversed(h.events)
                   if e.get("event") == "launch" and isinstance(e.get("hosts"), dict)), None)
    if launch is None:
        return None
    lost = [{"time": e.get("time"), "node": e.get("node"), "host": e.get("host"),
             "why": e.get("why")} for e in h.events if e.get("event") == "node_lost"]
    return {"attempt": launch.get("attempt"), "nodes": launch["hosts"], "lost": lost[-5:]}


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
    times = [t for t in (_num(last and last.get("time")),
                         _num(h.events[-1].get("time")) if h.events else None) if t is not None]
    finished_at = _num(fin.get("time")) if fin else None
    end = finished_at if finished_at is not None else (now if live else max(times, default=None))
    steps_per_s, tokens_per_s = rates(tail)
    step = last["step"] if last else next(
        (e["step"] for e in reversed(h.events) if isinstance(e.get("step"), int)), None)
    attempt = h.attempts[-1].attempt if h.attempts else (h.events[-1].get("attempt")
                                                         if h.events else None)
    return {
        "run_dir": str(h.run_dir), "journal": str(h.journal), "metrics": str(h.run_dir / METRICS),
        "name": h.name, "state": state, "live": live, "reason": reason, "exit_code": code,
        "supervisor_pid": h.pid, "started": h.started, "finished": finished_at,
        "elapsed_s": end - h.started if end is not None and h.started is not None else None,
        "last_update": max(times, default=None),
        "attempt": attempt, "attempts": len(h.attempts),
        "step": step, "loss": last.get("loss") if last else None,
        "steps_per_s": steps_per_s, "tokens_per_s": tokens_per_s, "mfu": median_mfu(tail),
        "loss_spread": row_loss_spread(last),
        "sdc": sdc_checks(h), "cadence": cadence(h), "nodes": nodes(h),
        "incident_count": len(h.incidents), "ignored_findings": len(h.ignored),
        "incidents": [i.to_json() for i in h.incidents[-RECENT_INCIDENTS:]],
        "attempt_history": [a.to_json() for a in h.attempts],
        "checkpoint_dir": str(h.checkpoint_root), "checkpoints": checkpoints(h),
    }


# -- human output ---------------------------------------------------------------------------------


def _clock(t: float | None, date: bool = False) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S", time.localtime(t))


def duration(seconds: float | None) -> str:
    """"42.0 s", "3.5 min", "2.1 h": short and readable at a glance."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _fmt(v: Any, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def describe_attempt(a: dict[str, Any], why: bool = True) -> str:
    """One line: what attempt ``a`` (an ``attempt_history`` entry) was told and, with ``why``,
    what made babysit launch it."""
    told = [f"resume step {a['resume_step']}" if a["resume_step"] is not None else "from start"]
    if a.get("resume_note") and a["resume_step"] is None:
        told[0] += f" ({a['resume_note'].split(':')[0]})"  # the gist: "no usable checkpoint"
    told += [f"skip batches {s}-{e - 1}" for s, e in a["skip"]]
    if a["lr_scale"] != 1.0:
        told.append(f"lr x{a['lr_scale']:g}")
    cause = a["cause"] if why else None
    reason = (f"after {cause['incident']} at step {cause['step']} -> {cause['action']}"
              if cause else "")
    return ", ".join(told) + (f"  ({reason})" if reason else "")


def render(s: dict[str, Any], now: float | None = None) -> str:
    """The human view of a ``snapshot``: aligned label/value lines, newest incidents last."""
    now = time.time() if now is None else now
    lines = [f"babysit status: {s['name'] or '?'}  ({s['run_dir']})"]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<12}{text}")

    state = s["state"] + (f" ({s['reason']})" if s["reason"] else "")
    row("state", state + (f", exit code {s['exit_code']}" if s["exit_code"] is not None else ""))
    ended = (f"finished {_clock(s['finished'])}" if s["finished"] else
             "still running" if s["live"] else "ended unexpectedly")
    row("time", f"started {_clock(s['started'], date=True)}, {ended}, ran "
                f"{duration(s['elapsed_s'])}")
    # max(0): another machine's clock may run ahead; "-3 s ago" would only confuse.
    ago = f", {duration(max(0.0, now - s['last_update']))} ago" if s["last_update"] else ""
    row("progress", f"attempt {_fmt(s['attempt'])} ({s['attempts']} launched), step "
                    f"{_fmt(s['step'])}, loss {_fmt(s['loss'])}{ago}")
    speed = f"{s['steps_per_s']:.2f} steps/s" if s["steps_per_s"] is not None else "- steps/s"
    if s["tokens_per_s"] is not None:
        speed += f", {s['tokens_per_s']:,.0f} tokens/s"
    if s["mfu"] is not None:
        speed += f", MFU {100 * s['mfu']:.1f}%"
    row("speed", speed)
    spread = s["loss_spread"]
    if spread is not None:
        row("rank loss", f"min {_fmt(spread['min'])} (rank {_fmt(spread['min_rank'])}), median "
                         f"{_fmt(spread['median'])}, max {_fmt(spread['max'])} (rank "
                         f"{_fmt(spread['max_rank'])})")
    if s["sdc"] is not None:
        sdc = s["sdc"]
        bad = "; ".join(f"step {d['step']} ranks {','.join(map(str, d['ranks']))}"
                        for d in sdc["disagreements"])
        row("sdc checks", f"{sdc['checks']} run, last agreeing step "
                          f"{_fmt(sdc['last_agreeing_step'])}"
            + (f"; disagreed at {bad}" if bad else "; all agreed"))
    if s.get("nodes") is not None:
        n = s["nodes"]
        text = ", ".join(f"{node} ({host})" for node, host in n["nodes"].items())
        lost = "; ".join(f"node {e['node']} ({e['host']}) at {_clock(e['time'])}: {e['why']}"
                         for e in n["lost"])
        row("nodes", f"{len(n['nodes'])} in attempt {_fmt(n['attempt'])}: {text}"
            + (f"; lost {lost}" if lost else ""))
    if s["cadence"] is not None:
        adopted = s["cadence"]["adopted_every"]
        row("cadence", str(s["cadence"].get("summary", "-"))
            + (f" (auto: now every {adopted} steps)" if adopted else ""))
    row("incidents", f"{s['incident_count']} acted on, {s['ignored_findings']} ignored"
                     + (" (newest last):" if s["incidents"] else ""))
    for i in s["incidents"]:
        ranks = ",".join(map(str, i["ranks"])) or "-"
        lines.append(f"    {_clock(i['time'])}  step {_fmt(i['step']):>6}  {i['incident']:<11}"
                     f" ranks {ranks:<5} -> {i['action']:<9} {i['message']}")
    row("attempts", "" if s["attempt_history"] else "none launched")
    for a in s["attempt_history"]:
        lines.append(f"    #{a['attempt']:<3} {_clock(a['time'])}  {describe_attempt(a)}")
    row("checkpoints", f"none in {s['checkpoint_dir']}" if not s["checkpoints"]
        else f"{len(s['checkpoints'])} in {s['checkpoint_dir']}")
    for c in s["checkpoints"][-5:]:
        why = f"  ({c['reason']})" if c["reason"] and c["verdict"] != "good" else ""
        lines.append(f"    step {_fmt(c['step']):>7}  {c['verdict']:<8}{why}")
    row("journal", s["journal"])
    return "\n".join(line.rstrip() for line in lines) + "\n"


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


def status_main(run_dir: str, as_json: bool, out: TextIO, err: TextIO | None = None) -> int:
    """``babysit status``: print the snapshot (human or ``--json``) to ``out``; return the exit
    code: 0, or 2 (a usage mistake) with one paragraph on ``err`` (stderr) if RUN_DIR is not a
    run directory."""
    node = follower_journal(Path(run_dir))
    if node is not None:  # one node's own journal of a multi-node run
        if as_json:
            out.write(json.dumps(journal_mod.json_safe(node), indent=2) + "\n")
        else:
            ended = (f"exit code {node['exit_code']}" if node["exit_code"] is not None
                     else "no end in its journal yet")
            out.write(f"babysit status: node {node['node']} of a multi-node run ({run_dir}), "
                      f"{ended}.\nThe run's record is the leader's: babysit status "
                      f"{node['record']}\n")
        return 0
    try:
        s = snapshot(run_dir)
    except NotARunDir as exc:
        print(f"babysit: error: {exc}", file=err or sys.stderr)
        return 2
    if as_json:
        out.write(json.dumps(journal_mod.json_safe(s), indent=2) + "\n")
    else:
        out.write(render(s))
    return 0
