"""The report's HTML page: summary, figures (relative links), attempts, incidents, silent data
corruption checks, checkpoints and their cadence.

One self-contained file plus its PNG folder; no scripts, no external assets, so it opens from a
laptop after ``scp -r`` of the run directory, or from a CI artifact.
"""

from __future__ import annotations

import html
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from babysit.supervisor.commands.history import sdc_disagreement
from babysit.supervisor.commands.metrics_file import to_float
from babysit.supervisor.commands.report import ledger
from babysit.supervisor.commands.report.data import RunData
from babysit.supervisor.commands.status import (
    describe_attempt,
    describe_memory,
    duration,
    goodput_line,
)

# The journal events the report already shows in its own sections; others are listed raw.
KNOWN_EVENTS = {"run_started", "launch", "worker_hello", "worker_close", "worker_skip", "state",
                "finding", "alert", "stop_workers", "workers_stopped", "backoff", "run_finished",
                "finding_set_aside", "incident", "resume", "sdc_check", "cadence_advice",
                "cadence_adopted", "goodput", "rerun", "memory_copy", "memory_copy_plan",
                "memory_cadence", "memory_copy_off"}
SHOWN = 20  # newest SDC disagreements and cadence changes listed; older ones are counted
CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1240px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 10px 3px 0; text-align: left;
         vertical-align: top; }
th { color: #555; font-weight: 600; }
table.kv th { width: 11em; }
.state-succeeded { color: #2a9d8f; } .state-failed, .state-abandoned { color: #d62828; }
.action-rollback { color: #9b5de5; } .action-stop { color: #d62828; }
.action-relaunch { color: #1f77b4; } .action-alert { color: #c77800; }
img { max-width: 100%; border: 1px solid #eee; } .muted { color: #777; }
code { font-size: 0.92em; }
"""


def _e(value: Any) -> str:
    return html.escape("-" if value is None else str(value))


def _num(v: Any, spec: str = ".4g") -> str:
    if isinstance(v, float):
        return format(v, spec) if math.isfinite(v) else str(v)
    return _e(v)


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    """``rows`` cells are already HTML (escape them with ``_e``)."""
    out = [f'<table class="{cls}">']
    if head:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows]
    return "\n".join(out) + "</table>"


def render(data: RunData, snap: dict[str, Any], figures: dict[str, str | None],
           page: Path) -> str:
    """The page that will be written at ``page``. ``snap`` is ``status.snapshot``; ``figures``
    maps a figure name to its PNG path relative to the page, or None when the run had nothing to
    draw for it."""
    name = snap["name"] or data.history.run_dir.name
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>babysit: {_e(name)}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>babysit report: {_e(name)}</h1>",
             f"<p class='muted'>{_e(snap['run_dir'])}; generated {_clock(time.time())}</p>",
             _summary(data, snap), _figures(data, figures),
             ledger.section(snap.get("goodput"), figures.get("goodput")), "<h2>Attempts</h2>",
             _attempts(data, snap), "<h2>Incidents</h2>", _incidents(data, page), _reruns(data),
             _sdc(data),
             "<h2>Checkpoints</h2>", _checkpoints(snap), _cadence(data), _config(data),
             _other_events(data),
             f"<p class='muted'>Journal: <code>{_e(snap['journal'])}</code>; metrics: "
             f"<code>{_e(snap['metrics'])}</code> ({data.rows:,} rows).</p></body></html>"]
    return "\n".join(p for p in parts if p)


def _summary(data: RunData, s: dict[str, Any]) -> str:
    state = f"<b class='state-{_e(s['state'])}'>{_e(s['state'])}</b>"
    if s["reason"]:
        state += f" ({_e(s['reason'])})"
    speed = f"{s['steps_per_s']:.2f} steps/s" if s["steps_per_s"] is not None else "-"
    if s["tokens_per_s"] is not None:
        speed += f", {s['tokens_per_s']:,.0f} tokens/s"
    if s.get("mfu") is not None:
        speed += f", MFU {100 * s['mfu']:.1f}% (median)"
    rows = [("state", state), ("exit code", _e(s["exit_code"])),
            ("started", _clock(s["started"])),
            ("finished", _clock(s["finished"]) if s["finished"] else
             "still running" if s["live"] else "-"),
            ("duration", duration(s["elapsed_s"])),
            ("attempts", f"{s['attempts']} launched, last #{_e(s['attempt'])}"),
            ("last step", f"{_e(s['step'])}, loss {_num(s['loss'])}"),
            ("speed (last 50 steps)", speed),
            ("throughput (whole run)", _throughput(data)),
            ("rank losses (last step)", _spread(s.get("loss_spread"))),
            ("goodput", _e(goodput_line(s["goodput"])) if s.get("goodput") else None),
            ("incidents", f"{s['incident_count']} acted on, {s['ignored_findings']} ignored")]
    return _table([], [[f"<b>{_e(k)}</b>", v] for k, v in rows if v is not None], "kv")


def _throughput(data: RunData) -> str | None:
    """Medians over every step of the run, or None when it reported neither tokens/s nor MFU."""
    parts = []
    for key, fmt in (("tokens_per_s", "{:,.0f} tokens/s"), ("mfu", "MFU {:.1%}")):
        values = np.concatenate([getattr(c, key) for c in data.curves] or [np.empty(0)])
        values = values[np.isfinite(values)]
        if len(values):
            parts.append(fmt.format(float(np.median(values))))
    return ", ".join(parts) + " (medians over all steps)" if parts else None


def _spread(spread: dict[str, Any] | None) -> str | None:
    if not spread:
        return None
    return (f"min {_num(spread['min'])} (rank {_e(spread['min_rank'])}), median "
            f"{_num(spread['median'])}, max {_num(spread['max'])} (rank {_e(spread['max_rank'])})")


def _figures(data: RunData, figures: dict[str, str | None]) -> str:
    captions = {
        "training": "Loss, grad norm and LR by step; one colour per attempt. Dashed lines: the "
                    "incident that ended an attempt and the action taken. Hatched: batches a "
                    "later attempt skipped (as first trained on). Red x at the top: non-finite. "
                    "Shaded around the loss, when reported: the lowest to the highest rank's "
                    "loss; red triangles: a rank whose loss departed from the others.",
        "throughput": "Job-wide tokens per second and model FLOPs utilisation (MFU) by step, "
                      "whichever the run reported; one colour per attempt, a rolling median "
                      "over the raw values (faint), the run's median dashed.",
        "scalars": "The other numbers the script reported with its steps (eval loss...), by "
                   "step; one colour per attempt, incidents and skipped batches as above.",
        "step_times": "Each rank's step time over the run (hangs shaded red, crashes "
                      "dash-dotted); a straggler stands out as a high "
                      "line (or a bright row) and a red bar. Large worlds report no per-rank "
                      "times: then the median, p99 and slowest rank's step time, and the ranks "
                      "that were the slowest most often.",
        "timeline": "Every finding over time, one row per kind, coloured by the policy's action "
                    "(markers close in time stacked within their row); hangs shaded red from "
                    "the last progress to the finding, crashes dash-dotted.",
    }
    out = []
    for key, caption in captions.items():
        src = figures.get(key)
        if src:
            out.append(f"<figure><img src='{_e(src)}' alt='{_e(key)}'><figcaption class='muted'>"
                       f"{_e(caption)}</figcaption></figure>")
    if data.rows == 0:
        out.append("<p><b>No metrics.</b> The script did not report steps through the worker "
                   "API (<code>supervisor.attach</code> and <code>run.step()</code>), so there "
                   "are no curves; babysit watched it by exit code only.</p>")
    return "\n".join(out)


def _attempts(data: RunData, s: dict[str, Any]) -> str:
    history = s["attempt_history"]
    if not history:
        return "<p>No attempt was launched.</p>"
    curves = {c.attempt: c for c in data.curves}
    rows = []
    for i, a in enumerate(history):
        c = curves.get(a["attempt"])
        steps = f"{int(c.step[0])}-{int(c.step[-1])} ({len(c.step)} rows)" if c else "none"
        last_loss = "-"
        if c is not None and len(c.loss):
            last_loss = "nan" if c.loss_bad[-1] else _num(float(c.loss[-1]))
        if i + 1 < len(history) and history[i + 1]["cause"]:
            nxt = history[i + 1]["cause"]
            ended = (f"<span class='action-{_e(nxt['action'])}'>{_e(nxt['incident'])} at step "
                     f"{_e(nxt['step'])} -> {_e(nxt['action'])}</span>")
        elif i + 1 < len(history):
            ended = "relaunched"
        else:
            ended = f"{_e(s['state'])}" + (f": {_e(s['reason'])}" if s["reason"] else "")
        told = _e(describe_attempt(a, why=False))
        rows.append([f"#{a['attempt']}", _clock(a["time"]), told, steps, last_loss, ended])
    return _table(["attempt", "launched", "told", "steps", "last loss", "ended"], rows)


def _link(target: str, page: Path) -> str:
    """``target`` relative to the page's folder, so the link survives copying the run dir."""
    try:
        return os.path.relpath(target, page.parent)
    except ValueError:  # another drive (Windows): an absolute link is all there is
        return target


def _incidents(data: RunData, page: Path) -> str:
    h = data.history
    out = []
    if h.incidents:
        rows = [[_clock(i.time), str(i.attempt), _e(i.step), _e(i.onset_step), _e(i.incident),
                 _e(i.severity), _e(",".join(map(str, i.ranks)) or "-"),
                 f"<b class='action-{_e(i.action)}'>{_e(i.action)}</b>",
                 f"{_e(i.message)}<br><span class='muted'>{_e(i.reason)}</span>"
                 + (f" <a href='{_e(_link(i.dir, page))}'>evidence</a>" if i.dir else "")]
                for i in h.incidents]
        out.append(_table(["time", "attempt", "step", "onset", "incident", "severity", "ranks",
                           "action", "what, and why this action"], rows))
    else:
        out.append("<p>None acted on.</p>")
    if h.ignored:
        counts = Counter(i.incident for i in h.ignored)
        steps = {k: [i.step for i in h.ignored if i.incident == k and i.step is not None]
                 for k in counts}
        text = "; ".join(f"{k} x{n}" + (f" (steps {min(steps[k])}-{max(steps[k])})"
                                        if steps[k] else "") for k, n in counts.items())
        out.append(f"<p class='muted'>Not acted on (the policy's cooldowns and thresholds, or "
                   f"set aside while the workers were being replaced): {_e(text)}.</p>")
    return "\n".join(out)


def _checkpoints(s: dict[str, Any]) -> str:
    memory = s.get("memory_copies")
    tier = (f"<p>In memory (each node's shared memory and its peer's): "
            f"{_e(describe_memory(memory))}.</p>" if memory is not None else "")
    if not s["checkpoints"]:
        return f"<p class='muted'>None in <code>{_e(s['checkpoint_dir'])}</code>.</p>" + tier
    rows = [[_e(c["step"]), _e(c["cursor"]), f"<b>{_e(c['verdict'])}</b>", _e(c["reason"]),
             f"<code>{_e(c['path'])}</code>"] for c in s["checkpoints"]]
    return _table(["step", "cursor", "verdict", "reason", "path"], rows) + tier


def _other_events(data: RunData) -> str:
    """Journal events this page has no section for: one row per kind, with how many there
    were and what the newest one said, in words (nested evidence is counted, never dumped)."""
    other = [e for e in data.history.events if e.get("event") not in KNOWN_EVENTS]
    if not other:
        return ""
    newest: dict[str, dict[str, Any]] = {}
    counts: dict[str, int] = {}
    for e in other:
        kind = str(e.get("event"))
        newest[kind] = e
        counts[kind] = counts.get(kind, 0) + 1
    rows = [[_e(kind), f"{counts[kind]:,}",
             _clock(e.get("time")) if isinstance(e.get("time"), (int, float)) else "-",
             _e(describe(e))] for kind, e in sorted(newest.items())]
    return ("<h2>Other journal events</h2>" + _table(["event", "count", "newest", "the newest "
                                                      "said"], rows))


def describe(e: dict[str, Any]) -> str:
    """One journal entry in a line of words."""
    kind = e.get("event")
    body: dict[str, Any] = e["data"] if isinstance(e.get("data"), dict) else {}
    if kind == "watch_state":
        return "the detectors' baselines and the ladders' state, kept for a supervisor taking over"
    if kind == "alert_delivery":
        r = e.get("result") or {}
        return f"{r.get('outcome')} to sink {r.get('sink')}: {r.get('title') or r.get('reason')}"
    if kind == "worker_scalars":
        values = body.get("values") or {}
        return f"rank {e.get('rank')}, step {body.get('step')}: " + ", ".join(
            f"{k} {_num(v)}" for k, v in values.items())
    if kind == "hang_diagnosis":
        return str(e.get("reason") or e.get("verdict") or "stacks dumped")
    return _words({k: v for k, v in e.items() if k not in ("time", "event", "attempt")})


def _words(fields: dict[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        if isinstance(value, dict):
            if value:
                parts.append(f"{key}: {_words(value)}" if len(value) <= 3 else
                             f"{key}: {len(value)} fields")
        elif isinstance(value, list):
            shown = ", ".join(map(str, value[:5])) + (", ..." if len(value) > 5 else "")
            parts.append(f"{key} [{shown}]" if all(not isinstance(v, (dict, list))
                                                    for v in value) else
                         f"{key}: {len(value)} items")
        elif key in ("created", "started", "finished") and isinstance(value, (int, float)):
            parts.append(f"{key} {_clock(value)}")
        elif value is not None:
            parts.append(f"{key} {_num(value) if isinstance(value, float) else value}")
    text = ", ".join(parts)
    return text if len(text) <= 240 else text[:239] + "…"


def _config(data: RunData) -> str:
    """The run's config as babysit read it (``config.yaml`` in the run folder)."""
    path = data.history.run_dir / "config.yaml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ""
    return (f"<h2>Run config</h2><p class='muted'>As babysit read it, defaults filled in "
            f"(<code>{_e(path)}</code>; every key: <code>babysit schema</code>).</p>"
            f"<details><summary>show</summary><pre>{_e(text)}</pre></details>")


def _events(data: RunData, kind: str) -> list[dict[str, Any]]:
    return [e for e in data.history.events if e.get("event") == kind]


def _ranges(ranks: list[int]) -> str:
    """"0-2, 4, 6-7": ranks as runs, so 64 ranks read as one short line."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _rank_ids(values: Any) -> list[int]:
    out = []
    for v in values if isinstance(values, (list, dict)) else ():
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            continue  # a malformed rank id: show the rest
    return out


def _digests(digests: Any, disagreeing: set[int], keys: int = 6) -> str:
    """Each compared key's digests, grouped by value: the odd one out reads at a glance (bold:
    the group holding a disagreeing rank)."""
    if not isinstance(digests, dict) or not digests:
        return "-"
    lines = []
    for key, by_rank in list(digests.items())[:keys]:
        groups: dict[str, list[int]] = {}
        for rank, digest in (by_rank.items() if isinstance(by_rank, dict) else ()):
            groups.setdefault(str(digest), []).extend(_rank_ids([rank]))
        parts = []
        for digest, ranks in sorted(groups.items(), key=lambda g: -len(g[1])):
            text = (f"<code>{_e(digest)}</code> rank{'s' if len(ranks) > 1 else ''} "
                    f"{_e(_ranges(ranks))}")
            parts.append(f"<b>{text}</b>" if len(groups) > 1 and disagreeing & set(ranks)
                         else text)
        lines.append(f"<code>{_e(key)}</code>: " + "; ".join(parts))
    if len(digests) > keys:
        lines.append(f"<span class='muted'>and {len(digests) - keys} more</span>")
    return "<br>".join(lines)


def _reruns(data: RunData) -> str:
    """The ``rerun`` events: whose fault each spike or NaN was, by rerunning its steps."""
    verdicts = _events(data, "rerun")
    if not verdicts:
        return ""
    rows = [[_e(e.get("step")), _e(e.get("attempt")), f"<b>{_e(e.get('verdict'))}</b>",
             _e(_ranges(_rank_ids(e.get("moved_first"))) or "-"), _e(e.get("summary"))]
            for e in verdicts[-SHOWN:]]
    return "\n".join(["<h2>Whose fault: reruns</h2>",
                      "<p>Each spike or NaN's steps were rerun from a checkpoint before it, "
                      "nothing skipped: back at the same batches is the data's (then skipped), "
                      "not back is a transient fault of the machine (nothing skipped).</p>",
                      _table(["step", "attempt", "verdict", "moved first", "summary"], rows)])


def _sdc(data: RunData) -> str:
    """The ``sdc_check`` events: how many, whether all agreed, and each disagreement."""
    checks = _events(data, "sdc_check")
    if not checks:
        return ""
    steps = [e["checked_step"] for e in checks if isinstance(e.get("checked_step"), int)]
    bad = [e for e in checks if sdc_disagreement(e)]
    last_ok = checks[-1].get("last_agreeing_step")  # as babysit status says it
    span = f" between steps {min(steps)} and {max(steps)}" if steps else ""
    out = ["<h2>Silent data corruption checks</h2>",
           f"<p>{len(checks)} check(s){span}, comparing {_e(checks[-1].get('ranks'))} ranks' "
           f"digests of state that should be identical across them."]
    if not bad:
        out[-1] += " <b class='state-succeeded'>All agreed.</b></p>"
        return "\n".join(out)
    out[-1] += (f" <b class='state-failed'>{len(bad)} disagreed.</b> Last step at which all "
                f"compared ranks agreed: <b>{_e(last_ok)}</b>.</p>")
    rows = []
    for e in bad[-SHOWN:]:
        odd = set(_rank_ids(e.get("disagreeing")))
        rows.append([_e(e.get("checked_step")), _e(e.get("attempt")), _e(e.get("ranks")),
                     f"<b>{_e(_ranges(sorted(odd)) or '-')}</b>", _e(e.get("last_agreeing_step")),
                     _digests(e.get("digests"), odd)])
    if len(bad) > SHOWN:
        out.append(f"<p class='muted'>The newest {SHOWN} of {len(bad)} disagreements:</p>")
    out.append(_table(["step", "attempt", "ranks compared", "disagreeing ranks",
                       "last agreeing step", "digests"], rows))
    return "\n".join(out)


def _share(v: Any) -> str:
    x = to_float(v)
    return "-" if x is None else f"{x:.1%}" if math.isfinite(x) else str(x)


def _seconds(v: Any) -> str:
    x = to_float(v)
    return duration(x) if x is not None and math.isfinite(x) else "-"


def _cadence(data: RunData) -> str:
    """The newest ``cadence_advice`` (checkpoint interval against its cost and the failure
    rate) and every ``cadence_adopted`` change."""
    advice, adopted = _events(data, "cadence_advice"), _events(data, "cadence_adopted")
    if not advice and not adopted:
        return ""
    out = ["<h2>Checkpoint cadence</h2>"]
    if advice:
        a = advice[-1]
        out.append(f"<p>{_e(a.get('summary'))} <span class='muted'>(the newest advice, step "
                   f"{_e(a.get('step'))}; {len(advice)} in all)</span></p>")
        configured, optimal = a.get("configured_steps"), a.get("optimal_steps")
        optimal_s = to_float(a.get("optimal_interval_s"))
        configured_s = None  # seconds per step, as the advice measured it, times the interval
        if isinstance(configured, int) and isinstance(optimal, int) and optimal > 0 \
                and optimal_s is not None:
            configured_s = configured * optimal_s / optimal
        rows = [["<b>interval</b>", f"every {_e(configured)} steps"
                 + (f" (about {_seconds(configured_s)})" if configured_s is not None else ""),
                 f"every {_e(optimal)} steps ({_seconds(optimal_s)})"],
                ["<b>expected waste</b>", _share(a.get("waste_configured")),
                 _share(a.get("waste_optimal"))]]
        out.append(_table(["", "configured", "optimal"], rows))
        tau = (f"{_seconds(a.get('tau_s'))} (source: {_e(a.get('tau_source'))}; "
               f"{_e(a.get('interruptions'))} interruption(s) seen in "
               f"{_seconds(a.get('observed_s'))})")
        out.append(_table([], [["<b>blocking cost C</b>",
                                f"{_seconds(a.get('blocking_s'))} of training per checkpoint"],
                               ["<b>tau</b>", f"mean time between interruptions: {tau}"]], "kv"))
    if adopted:
        items = [f"<li>step {_e(e.get('from_step', e.get('step')))}: checkpoint every "
                 f"{_e(e.get('old_every'))} -&gt; {_e(e.get('new_every'))} steps"
                 + (f" ({_e(e.get('reason'))})" if e.get("reason") else "") + "</li>"
                 for e in adopted[-SHOWN:]]
        out.append(f"<p>Adopted ({len(adopted)} change(s)):</p><ul>{''.join(items)}</ul>")
    return "\n".join(out)
