"""Progress read from what a script prints: stdout mode, for scripts that never call ``attach()``.

A rank's output line becomes the same ``RankStep`` the telemetry socket carries, so aggregation,
the detectors, ``metrics.jsonl`` and the status line need no second path. Recognised out of the
box (ANSI colours and a logger's prefix before the match are ignored)::

    nanoGPT        iter 120: loss 3.1234, time 45.67ms, mfu 12.34%
    HF Trainer     {'loss': 2.31, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.04}
    Lightning      Epoch 1:  40%|████  | 40/100 [00:02<00:03, 19.5it/s, v_num=0, train_loss=2.3]
    torchtitan     step: 10  loss:  7.8912  grad_norm:  1.2345  memory: 1.2GiB(3%)  tps: 1,234
    plain          step 12 loss 2.5   /   Step 12 | loss: 2.5 | lr: 3e-4   /   step=12 loss=2.5

A custom regular expression (``stdout.pattern``) replaces them all; its named groups ``step``
(optional), ``loss``, and optionally ``grad_norm``, ``lr``, ``tokens`` and ``step_time`` (seconds)
or ``step_time_ms`` fill the step.

Step numbers: a line that names its step is taken at its word. A Trainer dict names none; each
one counts one *logged* step (every ``logging_steps`` optimizer steps), which is what the
detectors and the hang allowance then measure. A Lightning bar names the batch within the epoch;
with the epoch's length it becomes a global batch index.

Pure: no I/O, times are passed in. ``ProgressParser.feed`` keeps per-rank state (the previous
step, for step times and Trainer counts) and must be given each rank's lines in order.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from babysit.policies.types import RankStep
from babysit.supervisor.config.schema import compile_pattern

__all__ = ["ProgressLine", "ProgressParser", "compile_pattern", "parse_line"]

_NUM = r"[-+]?(?:\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf)"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

_NANOGPT = re.compile(
    rf"\biter (?P<step>\d+): loss (?P<loss>{_NUM})"
    rf"(?:, time (?P<step_time_ms>{_NUM})ms)?")
_TITAN = re.compile(
    rf"\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{_NUM})"
    rf"(?:\s+grad_norm:\s*(?P<grad_norm>{_NUM}))?")
_LIGHTNING = re.compile(
    r"\bEpoch (?P<epoch>\d+):\s*\d+%\|[^|]*\|\s*(?P<batch>\d+)/(?P<total>\d+|\?)"
    rf"[^\]]*?\b(?:train_loss|loss)(?:_step)?=(?P<loss>{_NUM})")
_PLAIN = re.compile(
    rf"\bstep\b\s*[:=#]?\s*(?P<step>\d+)\b(?:\s*/\s*\d+)?[^\d\n]{{0,40}}?"
    rf"\b(?:train[_ ])?loss\b\s*[:=]?\s*(?P<loss>{_NUM})", re.IGNORECASE)
_EXTRAS = {
    "grad_norm": re.compile(rf"\b(?:grad_norm|gnorm|grad norm)\b\s*[:=]?\s*(?P<v>{_NUM})", re.I),
    "lr": re.compile(rf"\b(?:lr|learning_rate)\b\s*[:=]?\s*(?P<v>{_NUM})", re.I),
}
_EVAL_SUMMARY = re.compile(r"\btrain loss\b.*\bval loss\b")
"""nanoGPT's evaluation line (``step 250: train loss 1.9, val loss 2.0``): an estimate over
``eval_iters`` batches, not the step's own loss."""
_BARE_NONFINITE = re.compile(r"(?<=: )(-?inf|nan)(?=[,}])")
_TRAINER_DICT = re.compile(r"^\s*\{.*'loss':.*\}\s*$")


@dataclass(frozen=True, slots=True)
class ProgressLine:
    """What one printed line says about training. ``step`` is None when the line names none
    (a Trainer dict); times are seconds."""

    loss: float
    step: int | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: float | None = None
    step_time: float | None = None
    source: str = "plain"


def parse_line(text: str, pattern: re.Pattern[str] | None = None) -> ProgressLine | None:
    """What ``text`` (one line, rank prefix removed) says, or None if it is not a progress
    line. Carriage-return updates (progress bars) are read from the newest one."""
    text = _ANSI.sub("", text)
    if "\r" in text:
        for part in reversed(text.split("\r")):
            found = parse_line(part, pattern)
            if found is not None:
                return found
        return None
    if pattern is not None:
        return _custom(text, pattern)
    for parse in (_nanogpt, _trainer_dict, _lightning, _titan, _plain):
        found = parse(text)
        if found is not None:
            return found
    return None


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _with_extras(line: ProgressLine, text: str) -> ProgressLine:
    grad = line.grad_norm
    if grad is None and (m := _EXTRAS["grad_norm"].search(text)):
        grad = _number(m.group("v"))
    lr = line.lr
    if lr is None and (m := _EXTRAS["lr"].search(text)):
        lr = _number(m.group("v"))
    return ProgressLine(loss=line.loss, step=line.step, grad_norm=grad, lr=lr,
                        tokens=line.tokens, step_time=line.step_time, source=line.source)


def _nanogpt(text: str) -> ProgressLine | None:
    m = _NANOGPT.search(text)
    loss = _number(m.group("loss")) if m else None
    if m is None or loss is None:
        return None
    ms = _number(m.group("step_time_ms"))
    return ProgressLine(loss=loss, step=int(m.group("step")),
                        step_time=ms / 1000.0 if ms is not None else None, source="nanogpt")


def _trainer_dict(text: str) -> ProgressLine | None:
    if not _TRAINER_DICT.match(text):
        return None
    # Python prints non-finite floats bare (``'loss': nan``), which literal_eval refuses.
    text = _BARE_NONFINITE.sub(r"'\1'", text.strip())
    try:
        logged = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(logged, dict):
        return None

    def value(key: str) -> float | None:
        v = logged.get(key)
        # transformers >= 4.48 prints its numbers as strings: {'loss': '2.31', ...}
        if isinstance(v, (int, float, str)) and not isinstance(v, bool):
            return _number(str(v))
        return None

    loss = value("loss")
    if loss is None:
        return None
    step = logged.get("step")
    return ProgressLine(loss=loss, step=step if isinstance(step, int) else None,
                        grad_norm=value("grad_norm"), lr=value("learning_rate"),
                        source="trainer")


def _lightning(text: str) -> ProgressLine | None:
    m = _LIGHTNING.search(text)
    loss = _number(m.group("loss")) if m else None
    if m is None or loss is None:
        return None
    batch, total = int(m.group("batch")), m.group("total")
    # The bar counts batches within the epoch; with the epoch's length it is a global index.
    step = batch if total == "?" else int(m.group("epoch")) * int(total) + batch
    return ProgressLine(loss=loss, step=step, source="lightning")


def _titan(text: str) -> ProgressLine | None:
    m = _TITAN.search(text)
    loss = _number(m.group("loss")) if m else None
    if m is None or loss is None:
        return None
    return ProgressLine(loss=loss, step=int(m.group("step")),
                        grad_norm=_number(m.group("grad_norm")), source="torchtitan")


def _plain(text: str) -> ProgressLine | None:
    if _EVAL_SUMMARY.search(text):
        return None
    m = _PLAIN.search(text)
    loss = _number(m.group("loss")) if m else None
    if m is None or loss is None:
        return None
    return _with_extras(ProgressLine(loss=loss, step=int(m.group("step"))), text)


def _custom(text: str, pattern: re.Pattern[str]) -> ProgressLine | None:
    m = pattern.search(text)
    if m is None:
        return None
    groups = {k: v for k, v in m.groupdict().items() if v is not None}
    loss = _number(groups.get("loss"))
    if loss is None:
        return None
    step = groups.get("step")
    seconds = _number(groups.get("step_time"))
    ms = _number(groups.get("step_time_ms"))
    if seconds is None and ms is not None:
        seconds = ms / 1000.0
    return ProgressLine(loss=loss, step=int(step) if step and step.isdigit() else None,
                        grad_norm=_number(groups.get("grad_norm")), lr=_number(groups.get("lr")),
                        tokens=_number(groups.get("tokens")), step_time=seconds, source="pattern")


class ProgressParser:
    """Turns each rank's printed lines into ``RankStep``s, in order, per rank.

    ``feed(rank, text, now)``: ``now`` is the supervisor's wall clock when the line arrived
    (``time.time()``). Returns None for lines that are not progress, and for a line repeating
    the step it already reported (a progress bar redrawn). Step time is the line's own when it
    prints one, else the time since the rank's previous progress line divided by the steps
    between them (a script that logs every 10 steps still gets per-step times).
    """

    def __init__(self, pattern: re.Pattern[str] | None = None) -> None:
        self.pattern = pattern
        self._last: dict[int, tuple[int, float]] = {}
        self.sources: dict[int, str] = {}
        """Rank -> which format its lines matched first (for the journal)."""

    def reset(self) -> None:
        """A new attempt: its step numbers may go back (a rollback) and times start afresh."""
        self._last.clear()

    def feed(self, rank: int, text: str, now: float) -> RankStep | None:
        line = parse_line(text, self.pattern)
        if line is None:
            return None
        last = self._last.get(rank)
        step = line.step
        if step is None:  # a Trainer dict: one more logged step
            step = last[0] + 1 if last is not None else 1
        if last is not None and step == last[0]:
            return None
        step_time = line.step_time
        if step_time is None and last is not None and step > last[0]:
            step_time = (now - last[1]) / (step - last[0])
        self._last[rank] = (step, now)
        self.sources.setdefault(rank, line.source)
        return RankStep(rank=rank, step=step, time=now, loss=line.loss, grad_norm=line.grad_norm,
                        lr=line.lr, tokens=line.tokens, step_time=step_time)
