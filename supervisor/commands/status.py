"""``babysit status RUN_DIR``: where a run stands, live or finished, in a person's words or as
JSON (``--json``: the object ``babysit.supervisor.commands.history.snapshot`` documents).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from babysit.supervisor.commands.history import NotARunDir, follower_journal, snapshot
from babysit.supervisor.run import journal as journal_mod

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


def describe_memory(m: dict[str, Any]) -> str:
    """One line: the memory tier (a ``memory_copies`` snapshot entry)."""
    if m["off"]:
        return f"no copies: {m['off']}"
    told = [f"copies every {m['every']} steps" if m["every"] else "copies on",
            f"{m['copies']} made" + (f", newest of step {m['newest']}" if m["newest"] is not None
                                     else "")]
    if m["failed"]:
        first = m.get("first_failure") or {}
        told.append(f"{m['failed']} failed (the first, rank {first.get('rank')}'s of step "
                    f"{first.get('step')}: {first.get('error')})" if first else
                    f"{m['failed']} failed (the journal's memory_copy_failed says why)")
    return ", ".join(told)


def describe_attempt(a: dict[str, Any], why: bool = True) -> str:
    """One line: what attempt ``a`` (an ``attempt_history`` entry) was told and, with ``why``,
    what made babysit launch it."""
    told = [f"resume step {a['resume_step']}" if a["resume_step"] is not None else "from start"]
    if a.get("resume_samples") is not None:
        told[0] += f" at sample {a['resume_samples']}"
    note = a.get("resume_note") or ""
    if note and (a["resume_step"] is None or note.startswith("the script's own")):
        told[0] += f" ({note.split(':')[0]})"  # the gist: "no usable checkpoint"
    elif note.startswith("resumed from the just-in-time state"):
        told[0] += " (just-in-time state)"  # the whole story is the journal's resume entry
    elif note.startswith("resumed from the memory copy"):
        told[0] += " (memory copy)"
    told += [f"skip batches {r[0]}-{r[1] - 1}"
             + (f" (samples {r[2]}-{r[3] - 1})" if len(r) == 4 else "") for r in a["skip"]]
    ramp = a.get("lr_ramp")
    if ramp:
        told.append(f"lr x{a['lr_scale']:g} from batch {ramp.get('cut', ramp['start'])}, "
                    f"back to x{ramp['to']:g} over batches {ramp['start']}-{ramp['end'] - 1}")
    elif a["lr_scale"] != 1.0:
        told.append(f"lr x{a['lr_scale']:g}")
    cause = a["cause"] if why else None
    reason = (f"after {cause['incident']} at step {cause['step']} -> {cause['action']}"
              if cause else "")
    return ", ".join(told) + (f"  ({reason})" if reason else "")


def goodput_line(g: dict[str, Any]) -> str:
    """The ledger (``snapshot()['goodput']``) in one line: the productive share, then every
    badput category of at least 0.05 s, largest first."""
    if g.get("goodput") is None:
        return "- (no time recorded yet)"
    bad = sorted(((v, k) for k, v in g["seconds"].items() if k != "productive" and v >= 0.05),
                 reverse=True)
    return (f"{100 * g['goodput']:.1f}% of {duration(g['wall_s'])} productive"
            + ("; badput " + ", ".join(f"{k} {duration(v)}" for v, k in bad) if bad else ""))


def render(s: dict[str, Any], now: float | None = None) -> str:
    """The human view of a ``snapshot``: aligned label/value lines, newest incidents last."""
    now = time.time() if now is None else now
    lines = [f"babysit status: {s['name'] or '?'}  ({s['run_dir']})"]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<12}{text}")

    state = s["state"] + (f" ({s['reason']})" if s["reason"] else "")
    row("state", state + (f", exit code {s['exit_code']}" if s["exit_code"] is not None else ""))
    if s.get("verdict"):  # what the scheduler should do: requeue (75) or stop (1)
        v = s["verdict"]
        hosts = f"; exclude {', '.join(v['exclude_hosts'])}" if v.get("exclude_hosts") else ""
        row("verdict", f"{v['verdict']}: {v['why']}{hosts}")
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
        if n.get("spares"):
            row("spares", ", ".join(f"{node} ({host})" for node, host in n["spares"].items())
                + " waiting")
        for e in n.get("evicted", []):
            row("evicted", f"node {e['node']} ({e['host']}) at {_clock(e['time'])}: {e['why']}")
    if s.get("slurm") is not None:
        j = s["slurm"]
        done = {"requeue": "requeued", "cancel": "cancelled", None: "left to end by itself"}
        ended = (f": {done[j['action']]} ({j['why']})" if j["why"] else "")
        row("slurm", f"job {j['job_id']}{ended}" + (f"; failed: {j['error']}" if j["error"]
                                                      else ""))
    if s["cadence"] is not None:
        adopted = s["cadence"]["adopted_every"]
        row("cadence", str(s["cadence"].get("summary", "-"))
            + (f" (auto: now every {adopted} steps)" if adopted else ""))
    row("goodput", goodput_line(s["goodput"]) if s.get("goodput") else
        "- (metrics.jsonl over 16 MiB and no ledger journaled yet: see the run's Prometheus "
        "gauges, or its end)")
    for r in s.get("reruns", ()):
        row("rerun", f"{_clock(r['time'])}  {r['summary']}")
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
        kept = "  just-in-time" if c.get("origin") == "just_in_time" else ""
        lines.append(f"    step {_fmt(c['step']):>7}  {c['verdict']:<8}{kept}{why}")
    memory = s.get("memory_copies")
    if memory is not None:
        row("memory", describe_memory(memory))
    row("journal", s["journal"])
    return "\n".join(line.rstrip() for line in lines) + "\n"


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
