"""Shared fixtures. End-to-end tests run the real ``babysit`` CLI as a subprocess, which runs real
torchrun with real gloo workers; nothing in the process path is faked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
SITE = Path(__file__).resolve().parent / "site"
"""Its ``sitecustomize.py``: the suite's processes collect all their garbage less often (fewer
full collections, none at exit)."""
if str(SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE),
                                                             os.environ.get("PYTHONPATH")]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test in a module with a ``failure_context()`` shows it under the failure: the
    logs and journals of the real processes it ran, which a bare ``assert`` does not print."""
    report = yield
    context = getattr(getattr(item, "module", None), "failure_context", None)
    if report.when == "call" and report.failed and callable(context):
        report.sections.append(("babysit's processes", context()))
    return report


_SHM = Path("/dev/shm")
_SHM_BEFORE: set[str] = set()
"""babysit's folders in this machine's shared memory before the session (another run's)."""


def _shm_folders() -> set[str]:
    try:
        return {p.name for p in _SHM.iterdir() if p.name.startswith("babysit-")}
    except OSError:
        return set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that launch real jobs first, those with the most tests first among them, then
    the rest in their order: the two processes of ``-n 2 --dist loadfile
    --no-loadscope-reorder`` (the README's command) take files one at a time as they run out, so
    the long files start early and the short unit files fill in at the end, and both processes
    end together. (xdist's own order, by test count alone, leaves the one-test end-to-end files,
    a minute or more each, for the end.)"""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def order(group: list[pytest.Item]) -> tuple[int, int]:
        heavy = any(item.get_closest_marker("e2e") is not None for item in group)
        return (0, -len(group)) if heavy else (1, 0)

    ordered = sorted(files.values(), key=order)
    items[:] = [item for group in ordered for item in group]


def pytest_sessionstart(session: pytest.Session) -> None:
    _SHM_BEFORE.update(_shm_folders())
    if not hasattr(session.config, "workerinput"):
        _compile_babysit()


def _compile_babysit() -> None:
    """Byte-compile this checkout's package once, before any test starts a process: where
    ``PYTHONDONTWRITEBYTECODE`` is set (this machine's environment sets it), no interpreter
    writes the ``.pyc`` files of an editable install, and each of the suite's hundreds of
    babysitters, ranks and torchruns would compile babysit's modules from source again (0.6
    CPU-s against 0.4 for a babysitter's imports). An interpreter still reads ``.pyc`` files it
    did not write, checked against the source's time stamp."""
    import compileall

    for room in ("supervisor", "policies", "checkpoints"):
        compileall.compile_dir(ROOT / room, quiet=2, workers=1)
    compileall.compile_file(ROOT / "__init__.py", quiet=2)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Host memory is a training node's scarcest: no run of the session may leave a folder in
    /dev/shm behind (``supervisor/node/shm.py``). A leftover fails the session (checked where
    the whole session ends: not in a worker of ``pytest -n``, whose peers may still run)."""
    if hasattr(session.config, "workerinput"):
        return
    left = sorted(_shm_folders() - _SHM_BEFORE)
    if left:
        print(f"\nbabysit left {len(left)} folder(s) in {_SHM}: {', '.join(left[:8])}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def babysit_env() -> dict[str, str]:
    env = dict(os.environ)
    # The workers import the worker API from this checkout even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_babysit(*args: str, cwd: Path, timeout: float = 120,
                **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run the real CLI as a subprocess and wait for it."""
    return subprocess.run([sys.executable, "-m", "babysit", *args], cwd=cwd,
                          env=babysit_env(), capture_output=True, text=True, timeout=timeout,
                          **kw)


NOT_BABYSITS = (
    # c10d names each socket's peer by a reverse lookup of its address; the test's network
    # namespaces give their addresses no name (the machine's resolver, not babysit's settings).
    "The hostname of the client socket cannot be retrieved",
)
"""Warnings a clean run may print that no setting of babysit's causes or could prevent."""

_NOISE = re.compile(r"Warning|Traceback|\b[WE]\d{4} \d\d:\d\d:\d\d")
"""A warning or a traceback: Python's (``UserWarning:``, ``Traceback``), torch's C++ and its
launcher's log lines (``[W1128 03:32:07.40 Utils.hpp:137] Warning: ...``,
``W1128 03:32:03.71 5741 run.py:865] node_rank is only used...``)."""


def noise(console: str, alerts: bool = True) -> list[str]:
    """The lines of a console (babysit's, or an attempt's ``launcher.log``) that warn or trace
    back, but for ``NOT_BABYSITS``: on a clean run, what babysit could have prevented.
    ``alerts``: babysit's own warnings count too (``babysit: [warning] ...``)."""
    pattern = re.compile(_NOISE.pattern + (r"|\[warning\]|\[critical\]" if alerts else ""))
    return [line for line in console.splitlines()
            if pattern.search(line) and not any(known in line for known in NOT_BABYSITS)]


TEARDOWN_WARNING = ("babysit: [warning] every rank finished and closed, then the process "
                    "teardown crashed")
"""babysit's line for a teardown that crashed after every rank closed (``node/tick.py``)."""
_TORCHRUN_REPORT = re.compile(r"closing signal|failed \(exitcode: |Traceback \(most recent call "
                              r"last\)|ChildFailedError|Root Cause")
"""A line of torchrun's that begins its report of a failed rank (``node/reports.py``)."""


def console_noise(console: str, journal: list[dict[str, Any]], ranks: list[int],
                  alerts: bool = True) -> list[str]:
    """``noise`` of a run's console, where the run was clean, but for the lines of a teardown
    that gloo in torch 2.13 crashed by aborting a rank after every rank had closed its run
    ("terminate called without an active exception"): torchrun then stops the others and
    fails, babysit journals ``teardown_crash`` with every rank in ``closed_ranks``, warns and
    counts the run finished. Nothing of babysit's could prevent that. Its lines are babysit's
    warning and torchrun's report of the failure, from its first line in the last attempt
    (after the last ``starting -> running``) on; anything else on the console still counts."""
    torn = [e for e in journal if e["event"] == "teardown_crash"]
    if not torn or any(e["closed_ranks"] != ranks for e in torn):
        return noise(console, alerts=alerts)
    lines = console.splitlines()
    last = max((i for i, line in enumerate(lines)
                if line.startswith("babysit: starting -> running")), default=0)
    report = next((i for i in range(last, len(lines)) if lines[i].startswith("[torchrun] ")
                   and _TORCHRUN_REPORT.search(lines[i])), len(lines))
    kept = [line for i, line in enumerate(lines) if not line.startswith(TEARDOWN_WARNING)
            and not (i >= report and line.startswith("[torchrun] "))]
    return noise("\n".join(kept), alerts=alerts)


def take_over(config: Path, run_dir: Path, release: Path) -> tuple[int, str]:
    """Run ``babysit run config`` again on a run whose supervisor was killed: once it journals
    ``supervisor_takeover``, make ``release`` (the file the orphaned ranks hold on,
    ``tiny_train --hold-until``) so they go on. Returns its exit code and its output."""
    second = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)],
                              cwd=config.parent, env=babysit_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    events = run_dir / "events.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and second.poll() is None and not any(
                e["event"] == "supervisor_takeover" for e in read_jsonl(events)):
            time.sleep(0.1)
        release.touch()
        out, _ = second.communicate(timeout=180)
    finally:
        if second.poll() is None:
            second.kill()
    return second.returncode, out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def journal(run_dir: Path, event: str) -> list[dict[str, Any]]:
    """A run's journal entries of one kind, in order."""
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == event]


def newest_checkpoint_before(events: list[dict[str, Any]],
                             resume: dict[str, Any]) -> int | None:
    """The periodic checkpoint a just-in-time ``resume`` (a journal entry of ``events``) names
    as the newest before it, asserted honest: one the run saved before the step it resumed at,
    and none newer reported before the resume. (On a loaded machine an asynchronous save still
    in flight at the fault never commits; the resume then names the one before, and rightly.)"""
    at = resume["checkpoint_step"]
    saved = [e for e in events if e["event"] == "checkpoint_saved" and e["checkpoint_step"] < at]
    reported = [e["checkpoint_step"] for e in saved if e["time"] <= resume["time"]]
    named = resume["just_in_time"]["periodic_step"]
    if named is None:
        assert not reported, reported
    else:
        assert named in {e["checkpoint_step"] for e in saved}, (named, saved)
        assert named >= max(reported, default=named), (named, reported)
    return named


def final_eval(events: list[dict[str, Any]], step: int) -> float:
    """A run's held-out loss at ``step`` (``tiny_train.py --eval-every``; every rank holds the
    same model: one value), from its journal's entries."""
    [value] = {e["data"]["values"]["eval_loss"] for e in events
               if e["event"] == "worker_scalars" and e["data"]["step"] == step}
    return float(value)


T = TypeVar("T")


def kept_indices(launches: list[dict[str, Any]], index_log: Path,
                 steps: int) -> tuple[list[int], dict[int, set[int]]]:
    """What a run kept of ``tiny_train.py --index-log``'s record: each attempt's steps up to
    the step the next one resumed after (``launches``: the journal's ``launch`` entries), each
    step's indices all ranks' in rank order, step after step to ``steps``; and the world sizes
    each kept step was drawn at."""
    starts = {e["attempt"]: (e["directive"]["resume"] or {}).get("step", 0) for e in launches}
    ends = {a: starts.get(a + 1, steps) for a in starts}
    drawn: dict[int, list[tuple[int, list[int]]]] = {}
    worlds: dict[int, set[int]] = {}
    for log in index_log.iterdir():
        for line in log.read_text().splitlines():
            attempt, step, world, *idx = map(int, line.split())
            if starts[attempt] < step <= ends[attempt]:
                drawn.setdefault(step, []).append((int(log.name), idx))
                worlds.setdefault(step, set()).add(world)
    kept = [i for step in range(1, steps + 1) for _, idx in sorted(drawn[step]) for i in idx]
    return kept, worlds


def poll(fetch: Callable[[], list[T]], count: int, timeout: float = 2.0,
         keep: Callable[[T], bool] = lambda _: True) -> list[T]:
    """Call ``fetch`` (a non-blocking drain) until ``count`` items that ``keep`` accepts came
    back; fail if they do not within ``timeout`` s, or if more came."""
    got: list[T] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} arrived: {got}"
        got += [item for item in fetch() if keep(item)]
        time.sleep(0.005)
    assert len(got) == count, got
    return got


FAST_POLICY = ROOT / "tests" / "fast_policy.yaml"
"""The default policy with its waits shortened, so end-to-end tests take seconds."""


SYNC_SAVES = "{every_steps: 5, probation_steps: 5, async_save: false}"
"""The e2e tests' checkpoints: every save committed before the next step, so a test can say
which checkpoint a relaunch resumes from. The default (asynchronous: an in-flight save is not
yet resumable) runs where a test passes its own section."""


def babysat(tmp_path: Path, name: str, *args: str, nproc: int = 2,
            checkpoints: str = SYNC_SAVES,
            policy: str = f"{{name: {FAST_POLICY}}}", launch_extra: str = "", extra: str = "",
            script: Path = WORKERS / "tiny_train.py",
            ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run ``script`` with ``args`` under babysit from a config written to ``tmp_path``.

    ``checkpoints`` and ``policy`` are the YAML (flow style) of those sections,
    ``launch_extra`` lines go into the launch section (indented two spaces), ``extra`` lines at
    the top level. Returns the finished CLI process and the run directory."""
    run_dir = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"launch:\n  script: {script}\n  nproc-per-node: {nproc}\n"
        f"  args: {json.dumps(list(args))}\n{launch_extra}"
        f"run_dir: {run_dir}\ncheckpoints: {checkpoints}\npolicy: {policy}\n{extra}")
    return run_babysit("run", str(config), cwd=tmp_path, timeout=240), run_dir


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a YAML config into tmp_path and return its path."""

    def write(text: str, name: str = "run.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


WEBHOOK_SECRET = "T000/B000/SECRETxyz"
"""The secret-looking path in ``webhook``'s URL: it must never appear in a journal or output."""


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A webhook receiver on loopback (a real HTTP server): yields its URL, whose path holds
    ``WEBHOOK_SECRET``, and the list of what it received (each POST's path and JSON body)."""
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, "body": json.loads(body)})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/services/{WEBHOOK_SECRET}", received
    httpd.shutdown()
