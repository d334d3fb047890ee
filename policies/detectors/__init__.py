"""Detectors: pure functions of the telemetry stream, one small class per kind of trouble.

Every detector takes its config (a frozen pydantic model declared next to it) in the
constructor, does no I/O and never reads the clock; ``observe(...) -> Finding | None`` is its
verdict and ``state_dict()`` / ``load_state_dict()`` round-trip it through JSON mid-stream.

================  ===================  ===========================================
detector          observes             finding
================  ===================  ===========================================
LossSpike         StepRecord           LOSS_SPIKE: WARNING at onset, CRITICAL if it persists
NonFinite         StepRecord           NONFINITE: CRITICAL at once, names the ranks
GradNorm          StepRecord / value   GRAD_SPIKE: WARNING (worker skips the step)
Hang              RankStep + check()   HANG: CRITICAL, names the rank(s) that differ
Straggler         StepRecord           STRAGGLER: WARNING naming the rank
SlowCompute       StepRecord /         STRAGGLER: WARNING naming the rank(s) whose forward
                  SummaryRecord        lags for minutes, with what it costs the job
SlowLink          SummaryRecord        STRAGGLER: WARNING naming the node (its lowest rank)
                                       whose link's round trip lags for minutes
Throughput        StepRecord           THROUGHPUT: WARNING (steps/s, tokens/s or MFU)
RankDeparture     StepRecord           RANK_DEPARTURE: WARNING naming the rank
Sdc               per-rank digests     SDC: CRITICAL, names the ranks that disagree
ResumeLoss        a resume's first     RESUME: CRITICAL, the loss far above what was recorded
                  steps' loss          at the checkpoint's step
ResumeData        a resume's first     RESUME: WARNING, a global batch of another size than
                  steps' samples       the checkpoint's cursor counted (a resize)
classify()        exit + log tail      CrashVerdict (class, signature, deterministic)
================  ===================  ===========================================

The names are imported lazily, as ``babysit.policies``'s are: a worker runs the grad-norm guard
(``grad_guard``) in process, and importing it must not import every detector and pydantic with
it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from babysit.policies.detectors.crash import CrashClass, CrashSignature, CrashVerdict, classify
    from babysit.policies.detectors.grad_norm import GradNormConfig, GradNormDetector
    from babysit.policies.detectors.hang import HangConfig, HangDetector
    from babysit.policies.detectors.loss_spike import LossSpikeConfig, LossSpikeDetector
    from babysit.policies.detectors.nonfinite import NonFiniteConfig, NonFiniteDetector
    from babysit.policies.detectors.rank_departure import (
        RankDepartureConfig,
        RankDepartureDetector,
        loss_spread,
    )
    from babysit.policies.detectors.resume_data import GlobalBatch, ResumeData
    from babysit.policies.detectors.resume_loss import ResumeLoss, ResumeLossConfig
    from babysit.policies.detectors.sdc import SdcConfig, SdcDetector
    from babysit.policies.detectors.slow_compute import SlowComputeConfig, SlowComputeDetector
    from babysit.policies.detectors.slow_link import SlowLinkConfig, SlowLinkDetector
    from babysit.policies.detectors.straggler import StragglerConfig, StragglerDetector
    from babysit.policies.detectors.throughput import ThroughputConfig, ThroughputDetector

_LAZY = {
    "CrashClass": "crash",
    "CrashSignature": "crash",
    "CrashVerdict": "crash",
    "classify": "crash",
    "GradNormConfig": "grad_norm",
    "GradNormDetector": "grad_norm",
    "HangConfig": "hang",
    "HangDetector": "hang",
    "LossSpikeConfig": "loss_spike",
    "LossSpikeDetector": "loss_spike",
    "NonFiniteConfig": "nonfinite",
    "NonFiniteDetector": "nonfinite",
    "RankDepartureConfig": "rank_departure",
    "RankDepartureDetector": "rank_departure",
    "loss_spread": "rank_departure",
    "GlobalBatch": "resume_data",
    "ResumeData": "resume_data",
    "ResumeLoss": "resume_loss",
    "ResumeLossConfig": "resume_loss",
    "SdcConfig": "sdc",
    "SdcDetector": "sdc",
    "SlowComputeConfig": "slow_compute",
    "SlowComputeDetector": "slow_compute",
    "SlowLinkConfig": "slow_link",
    "SlowLinkDetector": "slow_link",
    "StragglerConfig": "straggler",
    "StragglerDetector": "straggler",
    "ThroughputConfig": "throughput",
    "ThroughputDetector": "throughput",
}
"""Each name's module in this package."""

__all__ = [
    "CrashClass",
    "CrashSignature",
    "CrashVerdict",
    "GlobalBatch",
    "GradNormConfig",
    "GradNormDetector",
    "HangConfig",
    "HangDetector",
    "LossSpikeConfig",
    "LossSpikeDetector",
    "NonFiniteConfig",
    "NonFiniteDetector",
    "RankDepartureConfig",
    "RankDepartureDetector",
    "ResumeData",
    "ResumeLoss",
    "ResumeLossConfig",
    "SdcConfig",
    "SdcDetector",
    "SlowComputeConfig",
    "SlowComputeDetector",
    "SlowLinkConfig",
    "SlowLinkDetector",
    "StragglerConfig",
    "StragglerDetector",
    "ThroughputConfig",
    "ThroughputDetector",
    "classify",
    "loss_spread",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
