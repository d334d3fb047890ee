"""torch's NCCL flight recorder: babysit points it at the attempt's folder, asks for a dump on a
hang, and copies it into the incident folder.

The rank side here is a thread that does what torch's NCCL monitor thread does with its dump
pipe (a real FIFO, read non-blocking; any byte means "dump now"), because NCCL needs a GPU. The
GPU suite (``tests/gpu/test_nccl.py``) checks the real thing.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from babysit.policies.types import Finding, Incident, Severity
from babysit.supervisor.config.plan import from_mapping
from babysit.supervisor.node import flight_recorder
from babysit.supervisor.node.incident import write_incident
from babysit.supervisor.node.workers import NodeWorkers

NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
         "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
         "TORCH_NCCL_DUMP_ON_TIMEOUT")


def test_the_ranks_environment_points_the_recorder_at_the_attempt(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    launch = {"script": "train.py", "env": {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}}
    plan = from_mapping({"launch": launch}, "test", tmp_path, "t", run_dir=str(tmp_path / "run"))
    workers = NodeWorkers(plan, plan.run_dir)
    attempt_dir = workers.attempt_dir(2)
    env = workers._env(attempt_dir, 2)
    prefix = str(attempt_dir / "flight_recorder" / "rank_")
    # torch 2.13 (pinned) reads the new names, and warns in every rank about the old ones.
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == prefix
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == prefix
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the user's launch.env wins
    assert (attempt_dir / "flight_recorder").is_dir()  # torch does not create it


def test_a_setting_the_user_made_under_any_of_its_names_is_left_alone(tmp_path: Path) -> None:
    assert set(flight_recorder.environment(tmp_path, {})) == set(NAMES)
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}
    added = flight_recorder.environment(tmp_path, mine, frozenset(NAMES))
    assert set(added) == {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"}


def test_a_renamed_setting_goes_under_the_newest_name_torch_reads(tmp_path: Path) -> None:
    """torch 2.13 holds both names of a renamed setting (and warns about the old one): the new
    one is set. A torch from before the rename holds only the old one: the old one is set. A
    torch that holds neither (a CPU build before the flight recorder left NCCL) or one not
    known: every name, as any torch reads one."""
    new = {"TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"}
    old = {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    always = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"}
    assert set(flight_recorder.environment(tmp_path, {}, frozenset(new | old))) == new | always
    assert set(flight_recorder.environment(tmp_path, {}, frozenset(old))) == old | always
    assert set(flight_recorder.environment(tmp_path, {}, frozenset())) == set(NAMES)
    assert set(flight_recorder.environment(tmp_path, {}, None)) == set(NAMES)


def test_what_torch_reads_is_found_in_its_native_libraries(tmp_path: Path) -> None:
    """The installed torch's libraries, read: torch 2.13 (pinned) holds both names of each
    renamed setting (its CPU build has no NCCL group, so not the NCCL-only two). Another
    interpreter's torch is not looked for. A file that is no ELF is searched whole."""
    reads = flight_recorder.torch_reads()
    assert reads is not None and {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                                  "TORCH_FR_DUMP_TEMP_FILE"} <= reads
    assert flight_recorder.torch_reads("/usr/bin/false") is None
    lib = tmp_path / "libtorch_cpu.so"
    lib.write_bytes(b"\x00" * 100 + b"TORCH_FR_BUFFER_SIZE\x00TORCH_FR_DUMP_TEMP_FILEX\x00")
    assert flight_recorder._names_in(lib, NAMES) == {"TORCH_FR_BUFFER_SIZE"}


def fake_rank(pipe: Path, dump: Path, stop: threading.Event, ready: threading.Event) -> None:
    """torch's side of the dump pipe: open it for reading, and on any byte write the dump.
    ``ready`` once it reads: a writer before that finds no reader (ENXIO), as with torch."""
    os.mkfifo(pipe)
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    ready.set()
    try:
        while not stop.is_set():
            try:
                if os.read(fd, 64):
                    dump.write_bytes(b"\x80\x04fake pickle of the ring buffer")
                    return
            except BlockingIOError:
                pass
            time.sleep(0.01)
    finally:
        os.close(fd)


def test_a_hang_incident_asks_the_ranks_to_dump_and_keeps_the_dumps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    attempt_dir = run_dir / "attempts" / "0"
    flight_recorder.prepare(attempt_dir)
    folder = attempt_dir / "flight_recorder"
    stop = threading.Event()
    ready = [threading.Event(), threading.Event()]
    ranks = [threading.Thread(target=fake_rank, args=(folder / f"rank_{r}.pipe",
                                                       folder / f"rank_{r}", stop, ready[r]))
             for r in (0, 1)]
    for thread in ranks:
        thread.start()
    try:
        # Both ranks read their pipes (a pipe that exists may not be open yet: that was a race).
        assert all(r.wait(10) for r in ready)
        finding = Finding(incident=Incident.HANG, detector="hang", severity=Severity.CRITICAL,
                          step=7, onset_step=7, ranks=(1,), message="hang at step 7")
        incident = write_incident(run_dir, 0, finding, "relaunch", None, {})
    finally:
        stop.set()
        for thread in ranks:
            thread.join()
    copies = sorted(p.name for p in (incident / "flight_recorder").iterdir())
    assert copies == ["rank_0", "rank_1"]
    assert (incident / "flight_recorder" / "rank_1").read_bytes().startswith(b"\x80\x04fake")
    assert "flight_recorder/" in (incident / "summary.txt").read_text()


def test_other_incidents_copy_the_watchdogs_dumps_and_ask_for_none(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    attempt_dir = run_dir / "attempts" / "1"
    flight_recorder.prepare(attempt_dir)
    folder = attempt_dir / "flight_recorder"
    (folder / "rank_3").write_bytes(b"written by NCCL's watchdog on its timeout")
    os.mkfifo(folder / "rank_3.pipe")
    reader = os.open(folder / "rank_3.pipe", os.O_RDONLY | os.O_NONBLOCK)  # a live rank
    try:
        finding = Finding(incident=Incident.CRASH, detector="crash", severity=Severity.CRITICAL,
                          step=9, onset_step=9, ranks=(3,), message="network crash")
        incident = write_incident(run_dir, 1, finding, "relaunch", None, {})
        assert os.read(reader, 64) == b""  # nothing was written to the pipe: no dump asked for
    finally:
        os.close(reader)
    assert [p.name for p in (incident / "flight_recorder").iterdir()] == ["rank_3"]


def test_without_nccl_there_is_nothing_to_collect_and_no_wait(tmp_path: Path) -> None:
    flight_recorder.prepare(tmp_path)
    # A pipe nobody reads (its rank died): skipped at once, not waited for.
    os.mkfifo(tmp_path / "flight_recorder" / "rank_0.pipe")
    started = time.monotonic()
    assert flight_recorder.collect(tmp_path, tmp_path / "incident", wait_s=30) == []
    assert time.monotonic() - started < 10  # it did not wait for a dump that cannot come
    assert not (tmp_path / "incident").exists()
