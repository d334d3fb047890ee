"""Replay: curve files in, the decisions babysit would have taken out."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import math
from pathlib import Path

import pytest

from babysit.policies.loader import load_policy
from babysit.policies.replay import CurveError, read_curve, replay, run_replay

CURVES = Path("/work/shared/data/curves")


def curve(n: int = 400, spike: tuple[int, int, float] | None = (250, 280, 1.5)) -> list[float]:
    out = []
    for s in range(1, n + 1):
        v = (3.0 + 2.0 * math.exp(-s / 80)) * (1 + 0.005 * math.sin(s * 1.7))
        if spike and spike[0] <= s < spike[1]:
            v *= spike[2]
        out.append(v)
    return out


def write_tsv(path: Path, losses: list[float], header: str = "train/lm_loss\tstep") -> Path:
    rows = [header] + [f"{v}\t{i + 1}" for i, v in enumerate(losses)]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_synthetic_tsv_spike_that_stays_is_rolled_back_after_patience(tmp_path: Path) -> None:
    decisions = replay(read_curve(write_tsv(tmp_path / "c.tsv", curve(spike=(250, 400, 1.5)))),
                       load_policy("default", {}))
    assert [(d.step, d.action) for d in decisions] == [(250, "alert"), (330, "rollback")]
    rollback = decisions[1]
    assert rollback.onset_step == 250 and rollback.detector == "loss_spike"
    # First a rerun of the same steps, nothing skipped and the LR kept (policies/rerun.py)...
    assert rollback.remedy["lr_scale"] == 1.0 and rollback.remedy["skip_after"] == 0
    assert "rerun steps to 330 first" in rollback.remedy["reason"]
    # ...or, with reruns off, the data's rollback at once: the skip and the LR cut.
    at_once = replay(read_curve(tmp_path / "c.tsv"),
                     load_policy("default", {"rollback": {"rerun_max_steps": 0}}))[1]
    assert at_once.remedy["lr_scale"] == 0.5 and at_once.remedy["lr_rewarm"] == 50


def test_synthetic_tsv_spike_that_heals_is_only_an_alert(tmp_path: Path) -> None:
    decisions = replay(read_curve(write_tsv(tmp_path / "c.tsv", curve())),
                       load_policy("default", {}))
    assert [(d.step, d.severity, d.action) for d in decisions] == [(250, "warning", "alert")]


def test_gzip_csv_with_grad_column_and_human_output(tmp_path: Path) -> None:
    p = tmp_path / "c.csv.gz"
    losses = curve(spike=None)
    with gzip.open(p, "wt") as f:
        f.write("step,loss,grad_norm\n")
        for i, v in enumerate(losses):
            g = 40.0 if i + 1 == 300 else 1.0 + 0.05 * math.sin(i)
            f.write(f"{i + 1},{v},{g}\n")
    out = io.StringIO()
    assert run_replay(str(p), "default", False, out) == 0
    text = out.getvalue()
    assert "step     300  grad_norm" in text and "skip_step" in text
    assert text.splitlines()[-1].startswith("replayed 400 steps")


def test_metrics_jsonl_run_directory_and_json_output(tmp_path: Path) -> None:
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for i, v in enumerate(curve()):
            f.write(json.dumps({"step": i + 1, "loss": v, "grad_norm": 1.0}) + "\n")
        f.write(json.dumps({"step": 401, "loss": float("nan")}) + "\n")
    out = io.StringIO()
    assert run_replay(str(tmp_path), "default", True, out) == 1
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {"step", "detector", "action"} <= set(lines[0])
    assert (401, "nonfinite", "rollback") in {(d["step"], d["detector"], d["action"])
                                               for d in lines}


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(CurveError, match=r"nope\.tsv does not exist"):
        read_curve(tmp_path / "nope.tsv")


def test_no_loss_column_lists_the_columns_found(tmp_path: Path) -> None:
    p = write_tsv(tmp_path / "c.tsv", [1.0, 2.0], header="value\tstep")
    with pytest.raises(CurveError) as e:
        read_curve(p)
    assert str(p) in str(e.value) and "['value', 'step']" in str(e.value)


def test_directory_without_metrics(tmp_path: Path) -> None:
    with pytest.raises(CurveError, match=r"without metrics\.jsonl"):
        read_curve(tmp_path)


def test_bad_number_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "c.tsv"
    p.write_text("loss\tstep\n3.0\t1\nbanana\t2\n")
    with pytest.raises(CurveError, match="line 3: column 'loss' holds 'banana'"):
        list(read_curve(p))


@pytest.mark.skipif(not CURVES.is_dir(), reason="shared Pythia curves not present")
def test_real_curves_clean_runs_never_roll_back_and_the_160m_spike_is_flagged() -> None:
    # The whole 14m run (its one-step outliers are spread over all of it), the 70m warmup and
    # early training, the 160m spikes; benchmarks/eval_detectors.py covers every step of all.
    policy = load_policy("default", {})
    for name, steps in (("pythia-14m-seed1", 143_000), ("pythia-70m-seed1", 20_000)):
        records = itertools.islice(read_curve(CURVES / f"{name}.tsv.gz"), steps)
        actions = {d.action for d in replay(records, policy)}
        assert actions <= {"alert"}, name
    spiky = replay(itertools.islice(read_curve(CURVES / "pythia-160m-seed7.tsv.gz"), 3000),
                   policy)
    flagged = [d for d in spiky if d.detector == "loss_spike" and 1190 <= d.step <= 1440]
    assert flagged, "the genuine early spikes of the 160m run were not flagged"


def test_a_pipeline_state_saved_before_the_new_detectors_still_loads() -> None:
    # A supervisor taking over a run journaled by an older babysit: detectors that did not
    # exist then start fresh instead of failing the takeover.
    from babysit.policies.pipeline import Pipeline

    pipe = Pipeline(load_policy("default", {}))
    state = json.loads(json.dumps(pipe.state_dict()))
    assert "rank_departure" in state["detectors"]
    del state["detectors"]["rank_departure"]
    Pipeline(load_policy("default", {})).load_state_dict(state)
