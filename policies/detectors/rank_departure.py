"""Rank departure: one rank's loss moves away from its own past while its peers' do not.

What it is for: a corrupted data shard or a faulty GPU shows as one rank whose loss jumps to a
new level (up or down) and stays there, while the job's mean loss, which the loss-spike
detector watches, moves by only 1/world_size of that.

Ranks normally sit at different loss levels (each reads its own shard), and with two ranks any
"distance from the median of all ranks" is symmetric: it cannot say which one moved. So each
rank is compared with its own past first, and with its peers second. Per step, in log-loss (so
scaling any rank's loss by a constant changes no verdict):

- own baseline ``b_r``: the median of the rank's last ``baseline_window`` (8) accepted
  log-losses, and its own change ``d_r = log(loss_r) - b_r``. The window is short so that a
  departure is judged against the level just before it.
- the peers' change ``m_r``: the median of ``d`` over the other ranks; the departure
  ``s_r = d_r - m_r``. A global spike, and the normal descent, move every rank alike and
  cancel here. So does the lag of the own baselines on a falling curve (about half a window of
  descent), which is the same for every rank.
- usual values: over the rank's last ``window`` (64) steps, the median and a robust sigma
  (interquartile range) of ``s_r`` (floored at ``min_sigma``; with fewer than 32 values the
  sigma is inflated by sqrt(32 / n), as in the loss-spike detector), and the median of
  ``m_r``. What counts below is the departure beyond its usual value, ``dep = s_r - median``,
  in noise units ``z = dep / sigma``, and the peers' change beyond its usual value, ``peers =
  m_r - median`` (on a falling curve that usual value is the baselines' lag: nobody moved).
- a rank departs at a step when ``|z| >= z_threshold`` AND ``dep`` is at least ``min_ratio``
  (either way) AND it is the one that moved: its own change ``dep + peers`` is larger than
  ``peers`` (with two ranks both have a large ``|z|``; this names the right one), and the
  peers stayed calm: ``|peers|`` under ``z_threshold / 2`` noise units or a third of
  ``|dep|``, and under ``|dep|``. When a global spike lifts every rank 2x, or the noise of
  every rank grows tenfold, one shard moving more than the others is no evidence of a broken
  rank; a bad shard does drag its peers a little through the shared gradient.
- the streak goes on while the rank stays at ``|z| >= z_threshold / 2`` in the same direction
  (and is still the one that moved), so one noisy step under the threshold does not restart it.
  ``patience`` steps of streak give one WARNING naming the rank, with ``onset_step`` the first
  step of the streak. It is not reported again until it has come back (``|z| < z_threshold /
  2``) for ``patience`` steps in a row. One report per call: a second rank due at the same step
  is reported at the next one.

What is learnt while a rank departs (from its streak's first step until it is back): nothing
that the departure would corrupt. Instead of its loss, its own baseline is fed its baseline at
the streak's first step plus the median movement of its peers' baselines since then (where it
would be had it moved as its peers did), so it keeps following the run's trend and a departure
that lasts for hours is still measured against where the rank belongs. (The peers' baselines
are medians of their real losses, so this anchor does not wander.) A rank's usual values learn
only at steps where fewer than half of its peers depart (with two ranks: only when neither
does). A rank that never comes back is reported once.

Limits: a rank that drifts away slowly, over more than ``baseline_window`` steps, is absorbed
into its own baseline and never reported; two ranks of a two-rank job that depart in opposite
directions at once cannot be told apart; a departure smaller than ``min_ratio`` is ignored
whatever its z; during a global excursion (every rank moving) nobody is named. Cost: one sort
of the ranks per step, so thousands of ranks are fine.

Calling rules: call ``observe`` once per merged ``StepRecord``, in step order. Ranks whose loss
is missing, non-finite (the nonfinite detector's job) or not positive are left out of that
step; steps with fewer than two such ranks are skipped without effect. A change of
``world_size`` starts over. Units: loss as reported; ``window``, ``baseline_window``,
``min_history`` and ``patience`` count observed steps.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, NamedTuple

from pydantic import Field, model_validator

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.detectors._window import SortedWindow
from babysit.policies.types import Finding, Incident, Severity, StepRecord, r4

# Below this many departures the noise estimate is inflated by sqrt(32 / n).
_FULL_SIGMA_N = 32


class RankDepartureConfig(DetectorConfig):
    window: int = Field(default=64, ge=8, le=100_000)
    """Steps of each rank's departure history, for its noise scale."""
    baseline_window: int = Field(default=8, ge=3, le=1000)
    """Steps in each rank's own moving median of log-loss. Short, so that its lag on a falling
    curve stays small next to a departure."""
    min_history: int = Field(default=16, ge=4)
    """No verdict on a rank before its departure history holds this many steps."""
    z_threshold: float = Field(default=5.0, gt=0.0)
    """A departing step needs a robust z-score (in units of the rank's departure noise) at
    least this..."""
    min_ratio: float = Field(default=1.1, gt=1.0, le=100.0)
    """...and the rank's loss at least this factor away (above or below) from where its peers'
    movement says it should be (1.1 = 10 %)."""
    patience: int = Field(default=10, ge=1)
    """Consecutive departing steps, in one direction, before the WARNING; also the calm steps
    after which a reported rank counts as back."""
    min_sigma: float = Field(default=0.005, gt=0.0)
    """Noise floor in log-loss units (0.005 ~ 0.5 %), so identical per-rank losses still give
    a finite z-score."""

    @model_validator(mode="after")
    def _history_fits(self) -> RankDepartureConfig:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history ({self.min_history}) must not exceed window ({self.window})"
            )
        return self


def loss_spread(record: StepRecord) -> dict[str, Any] | None:
    """The spread of the finite per-rank losses of one step, for status and reports:
    ``{"min", "median", "max", "min_rank", "max_rank"}``; None when no rank reported a finite
    loss. Ties name the lowest rank."""
    losses = sorted((r.loss, r.rank) for r in record.ranks
                    if r.loss is not None and math.isfinite(r.loss))
    if not losses:
        return None
    return {"min": losses[0][0], "median": statistics.median(v for v, _ in losses),
            "max": losses[-1][0], "min_rank": losses[0][1],
            "max_rank": min(k for v, k in losses if v == losses[-1][0])}


class _Verdict(NamedTuple):
    """One rank at one step, in log-loss units."""

    s: float
    """Departure: the rank's own change minus its peers' (raw, as learnt by the history)."""
    m: float
    """The peers' own change (median over the other ranks; raw, as learnt)."""
    dep: float | None
    """Departure beyond its usual value (``s`` minus the history's median); None in warm-up."""
    peers: float | None
    """Peers' change beyond its usual value (the trend's lag); None in warm-up."""
    sigma: float | None
    """Noise of the departure; None in warm-up."""


def _medians_of_others(values: dict[int, float]) -> dict[int, float]:
    """For each key, the median of the other keys' values: one sort, O(n log n) in all, so a
    thousand ranks cost a millisecond rather than a second."""
    order = sorted(values, key=values.__getitem__)
    srt = [values[k] for k in order]
    n = len(srt)
    if n < 2:
        return {}
    half = (n - 1) // 2

    def without(i: int, j: int) -> float:  # element j of the sorted values with i removed
        return srt[j + 1] if j >= i else srt[j]

    out: dict[int, float] = {}
    for i, k in enumerate(order):
        if (n - 1) % 2:
            out[k] = without(i, half)
        else:
            out[k] = 0.5 * (without(i, half - 1) + without(i, half))
    return out


def _new_rank(cfg: RankDepartureConfig) -> dict[str, Any]:
    return {"own": SortedWindow(cfg.baseline_window), "hist": SortedWindow(cfg.window),
            "peers": SortedWindow(cfg.window), "streak": 0, "sign": 0, "onset": None,
            "cursor": None, "reported": False, "calm": 0, "anchor": None,
            "peer_base": {}}


_WINDOWS = ("own", "hist", "peers")
_SCALARS = ("streak", "sign", "onset", "cursor", "reported", "calm", "anchor", "peer_base")


class RankDepartureDetector:
    """Names the rank whose loss left its own level while its peers stayed; see the module
    docstring."""

    name = "rank_departure"

    def __init__(self, config: RankDepartureConfig | None = None) -> None:
        self.config = config or RankDepartureConfig()
        self._log_min_ratio = math.log(self.config.min_ratio)
        self._world: int | None = None
        self._ranks: dict[int, dict[str, Any]] = {}

    def reset(self) -> None:
        """Forget every rank's history."""
        self._world = None
        self._ranks = {}

    def observe(self, record: StepRecord) -> Finding | None:
        cfg = self.config
        if record.world_size != self._world:
            self.reset()
            self._world = record.world_size
        y = {r.rank: math.log(r.loss) for r in record.ranks
             if r.loss is not None and math.isfinite(r.loss) and r.loss > 0.0}
        if len(y) < 2:
            return None
        st = {k: self._ranks.setdefault(k, _new_rank(cfg)) for k in y}
        base = {k: st[k]["own"].median() for k in y if len(st[k]["own"]) == cfg.baseline_window}
        d = {k: y[k] - b for k, b in base.items()}
        verdicts: dict[int, _Verdict] = {}
        for k, m in _medians_of_others(d).items():
            s = d[k] - m
            hist, peers = st[k]["hist"], st[k]["peers"]
            if len(hist) < cfg.min_history:
                verdicts[k] = _Verdict(s, m, None, None, None)
            else:
                verdicts[k] = _Verdict(s, m, s - hist.median(), m - peers.median(),
                                       self._sigma(hist))
        due: list[tuple[float, int, float]] = []
        for k, v in verdicts.items():
            z = self._update(st[k], record, v)
            if z is not None:
                due.append((abs(z), k, z))
        held = {k for k, r in st.items() if r["reported"] or r["streak"]}
        self._learn(st, y, base, verdicts, held)
        if not due:
            return None
        # One report per call; another rank due at the same step is reported at the next one.
        _, rank, z = max(due)
        return self._finding(record, rank, st[rank], z, verdicts[rank].dep or 0.0, y)

    def _update(self, r: dict[str, Any], record: StepRecord, v: _Verdict) -> float | None:
        """Advance one rank's streak or episode; its z when it is due to be reported."""
        cfg = self.config
        if v.dep is None or v.peers is None or v.sigma is None:
            return None
        z = v.dep / v.sigma
        if r["reported"]:
            r["calm"] = r["calm"] + 1 if abs(z) < cfg.z_threshold / 2 else 0
            if r["calm"] >= cfg.patience:
                r.update(reported=False, streak=0, sign=0, onset=None, cursor=None, calm=0)
            return None
        sign = 1 if z > 0 else -1
        # The rank moved away from itself more than its peers did and by more than they moved,
        # and its peers stayed calm: during a global spike or a burst of noise every rank
        # moves, and one moving more than the others is no evidence of a broken rank. Calm is
        # within the noise, or a third of the rank's own move: a shard gone bad drags its
        # peers a little through the shared gradient (seen on the demo model: the bad rank
        # 2.2x, its peer 1.25x). (Changes are taken beyond their usual values: on a falling
        # curve every rank's own baseline lags by the same amount, which is nobody's movement.)
        own = v.dep + v.peers
        calm = max(cfg.z_threshold / 2 * v.sigma, abs(v.dep) / 3)
        its_own = (abs(own) > abs(v.peers) and abs(v.dep) > abs(v.peers)
                   and abs(v.peers) < calm)
        if r["streak"] and sign == r["sign"] and its_own and abs(z) >= cfg.z_threshold / 2:
            # Hysteresis: once departed, a noisy step that dips under the threshold does not
            # break the streak; back under half of it does.
            r["streak"] += 1
        elif its_own and abs(z) >= cfg.z_threshold and abs(v.dep) >= self._log_min_ratio:
            r.update(streak=1, sign=sign, onset=record.step, cursor=record.cursor)
        else:
            r.update(streak=0, sign=0, onset=None, cursor=None)
        return z if r["streak"] >= cfg.patience else None

    def _learn(self, st: dict[int, dict[str, Any]], y: dict[int, float],
               base: dict[int, float], verdicts: dict[int, _Verdict], held: set[int]) -> None:
        for k, yk in y.items():
            r = st[k]
            if k not in held:
                r.update(anchor=None, peer_base={})
                r["own"].push(yk)
                continue
            if r["anchor"] is None:
                if k not in base:
                    continue
                r["anchor"] = base[k]
                r["peer_base"] = {str(j): b for j, b in base.items() if j != k}
            # Where the rank would be had it moved as its peers did since it departed: its
            # baseline keeps following the run's trend without taking in the departure. Peers'
            # baselines are medians of their real losses, so this does not wander.
            moves = [b - r["peer_base"][str(j)] for j, b in base.items()
                     if j != k and str(j) in r["peer_base"]]
            if moves:
                r["own"].push(r["anchor"] + statistics.median(moves))
        # A rank that is not held has len(verdicts) - 1 peers, n_held of them held.
        n_held = sum(k in held for k in verdicts)
        for k, v in verdicts.items():
            if k not in held and 2 * n_held < len(verdicts) - 1:
                st[k]["hist"].push(v.s)
                st[k]["peers"].push(v.m)

    def _sigma(self, hist: SortedWindow) -> float:
        n = len(hist)
        sigma = hist.iqr_sigma()
        if n < _FULL_SIGMA_N:
            # A quartile of a handful of values is itself noisy, and too small about as often as
            # too large; while history is short, err on the quiet side.
            sigma *= math.sqrt(_FULL_SIGMA_N / n)
        return max(sigma, self.config.min_sigma)

    def _finding(self, record: StepRecord, rank: int, r: dict[str, Any], z: float, dep: float,
                 y: dict[int, float]) -> Finding:
        r.update(reported=True, calm=0)
        loss = math.exp(y[rank])
        peer_loss = statistics.median(math.exp(x) for k, x in y.items() if k != rank)
        ratio = math.exp(dep)
        direction = "up" if r["sign"] > 0 else "down"
        return Finding(
            incident=Incident.RANK_DEPARTURE,
            detector=self.name,
            severity=Severity.WARNING,
            step=record.step,
            onset_step=r["onset"],
            onset_cursor=r["cursor"],
            ranks=(rank,),
            message=f"rank {rank}'s loss departed {direction} from its own level while its peers "
            f"stayed: {loss:.4g} at step {record.step} (peer median {peer_loss:.4g}), "
            f"{ratio:.3g}x where its peers' movement puts it, robust z {z:.1f}, for "
            f"{r['streak']} steps since step {r['onset']}",
            evidence={"rank": rank, "loss": r4(loss), "peer_median_loss": r4(peer_loss),
                      "ratio": r4(ratio), "direction": direction, "z": r4(z),
                      "streak": r["streak"]},
        )

    def state_dict(self) -> dict[str, Any]:
        return {"world": self._world, "ranks": {
            str(k): {**{w: r[w].state_dict() for w in _WINDOWS},
                     **{key: r[key] for key in _SCALARS}, "peer_base": dict(r["peer_base"])}
            for k, r in self._ranks.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._world = d["world"]
        self._ranks = {}
        for k, saved in d["ranks"].items():
            r = _new_rank(self.config)
            for w in _WINDOWS:
                r[w].load_state_dict(saved[w])
            r.update({key: saved[key] for key in _SCALARS})
            self._ranks[int(k)] = r
