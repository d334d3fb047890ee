"""Replay: run a recorded loss curve through the detectors and the rules, offline.

``babysit replay CURVE [--policy NAME|PATH] [--json]`` answers "what would babysit have done on
this run?" without launching anything. Curves come in two shapes:

- a TSV or CSV file, optionally gzip'd, with a header row: the step column is named ``step``
  (without one, the row number is the step), the loss column is the first whose name contains
  ``loss``, an optional grad-norm column is the first whose name contains ``grad``;
- a run directory holding ``metrics.jsonl``: one JSON object per line with at least ``step``
  and ``loss``, optionally ``grad_norm`` and ``time``.

Replayed steps are one rank each, one data batch per step (cursor = step) and, without a time
column, one second per step: cooldowns and budgets in seconds read as steps.

The same ``Pipeline`` (detectors + rules) is what the supervisor runs live; replay just feeds it
a file.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from babysit.policies.pipeline import Pipeline, ReplayDecision
from babysit.policies.schema import Policy
from babysit.policies.types import Action, RankStep, StepRecord


class CurveError(Exception):
    """A curve file cannot be replayed; the message names the file and what to do."""


# -- reading curves ---------------------------------------------------------------------------


def read_curve(path: str | Path) -> Iterator[StepRecord]:
    """Yield one ``StepRecord`` per row of a curve file or run directory (see module doc).

    Raises ``CurveError`` for a missing file, a missing loss column or an unparsable number.
    Checks happen before the first record is yielded where possible, so a bad file fails fast.
    """
    p = Path(path)
    if p.is_dir():
        metrics = p / "metrics.jsonl"
        if not metrics.is_file():
            raise CurveError(f"{p} is a directory without metrics.jsonl. Give a run directory "
                             "that has one, or a TSV/CSV curve file.")
        return _read_jsonl(metrics)
    if not p.is_file():
        raise CurveError(f"Curve file {p} does not exist. Give a TSV/CSV file (optionally "
                         ".gz) with a header row, or a run directory holding metrics.jsonl.")
    return _read_table(p)


def _open_text(p: Path) -> TextIO:
    with p.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    if gz:
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8", newline="")
    return p.open("r", encoding="utf-8", newline="")


def _num(text: str, p: Path, line: int, col: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise CurveError(f"{p}, line {line}: column '{col}' holds {text!r}, not a number. "
                         "Fix or remove that row.") from None


def _record(step: int, loss: float | None, grad: float | None, t: float | None) -> StepRecord:
    time = float(step) if t is None else t
    rank = RankStep(rank=0, step=step, time=time, cursor=step, loss=loss, grad_norm=grad)
    return StepRecord(step=step, time=time, ranks=(rank,), world_size=1)


def _read_table(p: Path) -> Iterator[StepRecord]:
    f = _open_text(p)
    try:
        header_line = f.readline()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        f.close()
        raise CurveError(f"Cannot read curve file {p}: {e}. Is it a text or gzip'd text "
                         "file?") from None
    delim = "\t" if "\t" in header_line else ","
    header = [h.strip() for h in next(csv.reader([header_line], delimiter=delim), [])]
    lower = [h.lower() for h in header]
    loss_i = next((i for i, h in enumerate(lower) if "loss" in h), None)
    if loss_i is None:
        f.close()
        raise CurveError(f"Curve file {p} has no loss column: its header has "
                         f"{header or 'nothing'}. Name the loss column with 'loss' in it "
                         "(e.g. 'train/loss').")
    step_i = lower.index("step") if "step" in lower else None
    grad_i = next((i for i, h in enumerate(lower) if "grad" in h), None)
    return _rows(f, p, delim, header, loss_i, step_i, grad_i)


def _rows(f: TextIO, p: Path, delim: str, header: list[str], loss_i: int, step_i: int | None,
          grad_i: int | None) -> Iterator[StepRecord]:
    with f:
        for n, row in enumerate(csv.reader(f, delimiter=delim), start=2):
            if not row:
                continue
            if len(row) < len(header):
                raise CurveError(f"{p}, line {n}: {len(row)} fields, the header has "
                                 f"{len(header)}. Fix or remove that row.")
            if step_i is None:
                step = n - 1
            else:
                s = _num(row[step_i], p, n, header[step_i])
                if s is None:
                    continue
                step = int(s)
            loss = _num(row[loss_i], p, n, header[loss_i])
            grad = None if grad_i is None else _num(row[grad_i], p, n, header[grad_i])
            yield _record(step, loss, grad, None)


def _read_jsonl(p: Path) -> Iterator[StepRecord]:
    with p.open("r", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                step = int(obj["step"])
                loss = None if obj["loss"] is None else float(obj["loss"])
            except (ValueError, KeyError, TypeError) as e:
                what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
                raise CurveError(f"{p}, line {n}: not a metrics record ({what}). Each line "
                                 "must be a JSON object with at least 'step' and 'loss'.") from None
            g = obj.get("grad_norm")
            t = obj.get("time")
            yield _record(step, loss, None if g is None else float(g),
                          None if t is None else float(t))


# -- replaying ---------------------------------------------------------------------------------


def replay(records: Iterable[StepRecord], policy: Policy) -> list[ReplayDecision]:
    """Every decision the policy takes over ``records`` (including ignored findings)."""
    pipe = Pipeline(policy)
    out: list[ReplayDecision] = []
    for record in records:
        out.extend(pipe.observe(record))
    return out


_INTERVENTIONS = {Action.ROLLBACK.value, Action.RELAUNCH.value, Action.STOP.value}


def run_replay(curve_path: str, policy: str, as_json: bool, out: TextIO) -> int:
    """``babysit replay``: print each decision (human lines or JSON lines) to ``out``.

    Returns 0 when babysit would only have watched or alerted, 1 when it would have intervened
    (rolled back, relaunched or stopped), so scripts can ask "would it have stepped in?".
    Raises ``CurveError`` / ``PolicyError`` (one-paragraph messages) for bad inputs.
    """
    from babysit.policies.loader import load_policy

    pol = load_policy(policy, {})
    n = 0
    last_step: int | None = None
    decisions: list[ReplayDecision] = []
    pipe = Pipeline(pol)
    for record in read_curve(curve_path):
        n += 1
        last_step = record.step
        for dec in pipe.observe(record):
            decisions.append(dec)
            if as_json:
                out.write(json.dumps(dec.to_json(), default=str) + "\n")
            else:
                out.write(_human(dec) + "\n")
    if n == 0:
        raise CurveError(f"Curve {curve_path} has a header but no rows: nothing to replay.")
    counts = Counter(d.action for d in decisions)
    if not as_json:
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no findings"
        out.write(f"replayed {n} steps (last step {last_step}) with policy '{policy}': "
                  f"{summary}\n")
    return 1 if _INTERVENTIONS & set(counts) else 0


def _human(d: ReplayDecision) -> str:
    return (f"step {d.step:>7}  {d.detector:<11} {d.severity:<8} -> {d.action:<9} "
            f"{d.message}")
