"""``babysit status`` says what a failed run tells its scheduler (requeue or stop, why, the
hosts to leave out), read from a real journal file."""

from __future__ import annotations

import io
import json
from pathlib import Path

from babysit.supervisor.commands.status import status_main


def write(run_dir: Path, *entries: dict[str, object]) -> None:
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_a_requeued_run_says_so_with_its_hosts_and_a_succeeded_one_says_nothing(
        tmp_path: Path) -> None:
    started = {"time": 100.0, "event": "run_started", "attempt": 0, "name": "r", "pid": 1}
    write(tmp_path / "lost", started, {
        "time": 160.0, "event": "run_finished", "attempt": 2, "step": 90, "state": "failed",
        "exit_code": 75, "reason": "node_lost ladder exhausted", "verdict": "requeue",
        "why": "outside the job (node_lost): the ladder's last rung",
        "exclude_hosts": ["gpu-3"]})
    out = io.StringIO()
    assert status_main(str(tmp_path / "lost"), False, out) == 0
    text = out.getvalue()
    assert "exit code 75" in text
    assert "verdict     requeue: outside the job (node_lost): the ladder's last rung; " \
           "exclude gpu-3" in text
    out = io.StringIO()
    status_main(str(tmp_path / "lost"), True, out)
    assert json.loads(out.getvalue())["verdict"]["exclude_hosts"] == ["gpu-3"]

    write(tmp_path / "fine", started, {"time": 160.0, "event": "run_finished", "attempt": 0,
                                       "step": 90, "state": "succeeded", "exit_code": 0,
                                       "reason": "workers finished"})
    out = io.StringIO()
    status_main(str(tmp_path / "fine"), False, out)
    assert "verdict" not in out.getvalue()


def test_a_run_under_slurm_says_what_its_end_did_to_the_job(tmp_path: Path) -> None:
    started = {"time": 100.0, "event": "run_started", "attempt": 0, "name": "r", "pid": 1}
    launch = {"time": 101.0, "event": "launch", "attempt": 0, "hosts": {"0": "n0", "1": "n1"},
              "nodes": [0, 1], "slurm": {"job_id": "42", "node": "n0",
                                          "took": {"launch.node_rank": "0 (SLURM_NODEID)"}}}
    write(tmp_path / "run", started, launch, {
        "time": 160.0, "event": "run_finished", "attempt": 1, "step": 90, "state": "succeeded",
        "exit_code": 0, "reason": "workers finished"}, {
        "time": 160.1, "event": "slurm_job", "attempt": 1, "job_id": "42", "action": "cancel",
        "why": "node 1 (n1) was lost", "exclude": [], "error": None})
    out = io.StringIO()
    assert status_main(str(tmp_path / "run"), False, out) == 0
    assert "slurm       job 42: cancelled (node 1 (n1) was lost)" in out.getvalue()
    out = io.StringIO()
    status_main(str(tmp_path / "run"), True, out)
    assert json.loads(out.getvalue())["slurm"] == {
        "job_id": "42", "took": {"launch.node_rank": "0 (SLURM_NODEID)"}, "action": "cancel",
        "why": "node 1 (n1) was lost", "error": None}
