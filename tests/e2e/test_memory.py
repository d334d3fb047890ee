"""Memory copies for real (``checkpoints/memory.py``): an FSDP2 job whose rank dies holding the
only copy of its shard resumes from the newest copy in its node's shared memory, not from the
checkpoint on disk, and a copy whose bytes went bad is refused by its CRC for the one before.

The interval is left to its default (``auto``): the run says at its start which it chose and
from what figures. The two-node case (a node lost with its memory, its shard resumed from the
replica the other node kept) is ``test_just_in_time.py``'s matrix.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from babysit.supervisor.commands.report import write_report
from babysit.supervisor.commands.status import status_main
from tests.conftest import FAST_POLICY, babysat, journal, read_jsonl

pytestmark = pytest.mark.e2e

STEPS = 120
ARGS = ("--fsdp", "--steps", str(STEPS), "--step-sleep", "0.02", "--eval-every", "60")
SAVES = "{every_steps: 100, probation_steps: 5, async_save: true, cadence: {mtbf_prior_s: 10}}"
"""Checkpoints on disk every 100 steps; memory copies as ``auto`` chooses (a short prior
between interruptions, so that its interval is a few steps here as it is minutes on a job)."""


def _losses(run_dir: Path) -> dict[int, list[float]]:
    return {m["step"]: m["loss_per_rank"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def _eval(run_dir: Path) -> float:
    return [e["data"]["values"]["eval_loss"] for e in journal(run_dir, "worker_scalars")
            if e["data"]["step"] == STEPS][-1]


def test_a_dead_fsdp2_rank_resumes_from_the_newest_good_copy_in_memory(
        tmp_path: Path) -> None:
    clean, clean_dir = babysat(tmp_path, "clean", *ARGS, checkpoints=SAVES,
                               launch_extra="  warm_standby: false\n")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # Rank 1 finds its shard in the newest copy bad (a flipped byte), then dies of SIGSEGV.
    result, run_dir = babysat(tmp_path, "faults", *ARGS, "--at", "0:1:83:memflip",
                              "--at", "0:1:83:SIGSEGV", checkpoints=SAVES,
                              policy=f"{{name: {FAST_POLICY}}}")
    assert result.returncode == 0, result.stdout + result.stderr
    events = read_jsonl(run_dir / "events.jsonl")

    # auto: copies on (FSDP2's shards have one holder each), the interval chosen and said.
    [chosen] = journal(run_dir, "memory_cadence")
    plan, *again = journal(run_dir, "memory_copy_plan")
    assert plan["data"]["auto"] and plan["data"]["node_bytes"]["0"] > 0
    assert result.stdout.count("babysit: memory copies from step 10 on") == 1
    # The relaunch goes on at the interval chosen, not from the start.
    assert [e["data"]["every"] for e in again] == [chosen["every_steps"]]
    assert 1 <= chosen["every_steps"] <= 100 and chosen["stall_s"] > 0
    assert f"babysit: memory copies every {chosen['every_steps']} steps: a copy stalls" \
        in result.stdout

    # The just-in-time state could not be written (rank 1 held half the state, and is dead).
    [kept] = journal(run_dir, "just_in_time")
    assert kept["outcome"] == "none" and "rank 1 is dead" in kept["why"]
    # The newest copy committed before the fault was refused by its CRC; the one before it
    # (in memory: newer than anything on disk) resumed the run.
    copies = [e["checkpoint_step"] for e in events if e["event"] == "memory_copy"
              and e["attempt"] == 0]
    finding = next(e for e in events if e["event"] == "finding"  # not a loaded machine's alert
                   and e["finding"]["incident"] == "crash")
    before = [s for s in copies if s < 83 and any(
        e["event"] == "memory_copy" and e["checkpoint_step"] == s
        and e["time"] < finding["time"] for e in events)]
    [refused] = [e for e in events if e["event"] == "checkpoint_refused"]
    assert refused["checkpoint_step"] == before[-1] and "CRC-32" in refused["problems"][0]
    [resumed] = [e for e in events if e["event"] == "resume" and e.get("from")]
    assert resumed["origin"] == "memory" and resumed["checkpoint_step"] == before[-2]
    assert f"babysit: resumed from the memory copy of step {before[-2]}" in result.stdout
    # Bit for bit the clean run, every step and the held-out loss.
    losses, clean_losses = _losses(run_dir), _losses(clean_dir)
    assert all(losses[s] == clean_losses[s] for s in clean_losses)
    assert _eval(run_dir) == _eval(clean_dir)
    # `babysit status` says it: the tier's line, and the attempt resumed from a copy.
    out = io.StringIO()
    assert status_main(str(run_dir), False, out) == 0
    made = sum(e["event"] == "memory_copy" for e in events)
    newest = [e["checkpoint_step"] for e in events if e["event"] == "memory_copy"][-1]
    assert (f"  memory      copies every {chosen['every_steps']} steps, {made} made, "
            f"newest of step {newest}") in out.getvalue()
    assert f"resume step {before[-2]} (memory copy)" in out.getvalue()
    # ... and so does the report, in its Checkpoints section.
    page = write_report(run_dir).read_text()
    assert (f"In memory (each node's shared memory and its peer's): copies every "
            f"{chosen['every_steps']} steps, {made} made") in page
