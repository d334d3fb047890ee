"""Every rank's stack when a job hangs, and the rank that differs from the rest.

    dumps, verdict = diagnose({0: 4242, 1: 4243})   # rank -> pid; 0.1 to 1 s, see below
    verdict.suspects     # (1,)
    verdict.reason       # "rank 1 is outside any collective, at main (train.py:45), while
                         #  rank 0 waits for it in DDP's gradient all-reduce, c10d::Reducer..."
    dumps[0].raw         # py-spy's own text, for the incident folder

``dump_stacks`` runs ``py-spy dump`` on every pid at once (side effects, never raises);
``odd_one_out`` is pure and judges the dumps; ``diagnose`` does both, and goes back for native
frames only when the Python frames cannot tell (see below).

Why py-spy, from outside: a hung rank cannot be asked anything, and the worker API must not run
a helper thread in every rank just for this. ``py-spy dump --pid`` reads the interpreter's memory
with ptrace, so it needs the same user (or root) and ``kernel.yama.ptrace_scope`` <= 1 where Yama
is on; a failure says so in ``StackDump.hint``.

How a rank is judged. In a hang someone is missing from a collective: the ranks that reached it
wait inside it, and the one that did not is elsewhere. So a rank whose stack is inside a
``torch.distributed`` collective is *waiting*, and ranks outside any collective are the
suspects. That rule goes first because it is physical; a plain majority vote would blame the one
waiting rank when seven are stuck together on a shared file system. When the rule cannot split
the ranks (all wait, or none shows a collective), the majority decides: ranks whose main-thread
signature (file:function per frame, innermost first, line numbers ignored, babysit's worker API,
``threading`` and import machinery left out) differs from a strict majority are the suspects.
With two ranks there is no majority, so there only the collective rule can name anyone.

Measured here (torch 2.13 CPU, gloo, py-spy 0.4.3, a 2-rank job hung in ``all_reduce``):
- ``py-spy dump`` takes 0.04-0.1 s per rank, blocking or ``--nonblocking`` alike; 8 processes
  dumped at once took 0.19 s on this 2-core machine (1: 0.04 s), so the round costs about
  one dump per core, not one per rank. We keep the default, blocking: it pauses the rank for
  those milliseconds, which a hung rank does not notice, while a non-blocking read of a rank
  that is still running can mix frames from two moments (py-spy: "may be inaccurate").
- ``--native`` took 0.8 s per rank (3.5 s while the rank was importing torch) and prints C++
  frames of a few hundred characters each (pybind11 templates), so it is not the default. But
  DDP waits for its gradient all-reduce inside ``loss.backward()`` (C++
  ``c10d::Reducer::finalize_backward``), and ``work.wait()`` of an async collective is C++ as
  well: there the Python frames show no collective. ``diagnose`` then dumps again with
  ``--native`` and judges on ``c10d::``/``gloo::``/NCCL frames. Both DDP jobs here (the demo
  and ``tests/workers/tiny_train.py``) need it: 2 ranks, Python pass plus native pass, 0.9 s.

The flight recorder (investigated, not used). In torch 2.13 gloo records collectives by
default (``torch._C._distributed_c10d._dump_fr_trace_json()`` in the rank lists each all_reduce
with its sequence id, sizes and state; ``TORCH_FR_BUFFER_SIZE`` sizes it; with default settings
the entries carried no stack). But it lives in the rank's memory and only the rank can serialize it:
there is no dump on timeout for gloo, no signal handler, and py-spy cannot call into the
process. The one way out is cooperation: ``torch._C._distributed_c10d._WorkerServer(path)``
started in the rank (as ``torch.distributed.elastic.control_plane.worker_main`` does from
``TORCH_WORKER_SERVER_SOCKET``) serves ``POST /handler/fr_trace_json`` and
``/handler/dump_traceback`` over a Unix socket from a C++ thread, and it answered while the main
thread was blocked in ``all_reduce``. That would belong in the worker API (``attach()``), not
here, so this module does not do it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple

from babysit.policies.wording import said_ranks

__all__ = [
    "Diagnosis",
    "Frame",
    "StackDump",
    "StackVerdict",
    "ThreadStack",
    "collective_frame",
    "deepen",
    "diagnose",
    "dump_stacks",
    "find_py_spy",
    "odd_one_out",
    "parse_dump",
]

EVIDENCE_FRAMES = 3
"""How many innermost frames of each rank a verdict quotes."""

# Leaf names of torch.distributed's collectives and waits, as py-spy prints the Python frame.
_COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_gather_coalesced", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "wait", "_wait",
    "send_object_list", "recv_object_list",
})
# Native frames (with --native) that mean "blocked on the other ranks": c10d's Work::wait,
# DDP's Reducer, the gloo and NCCL backends.
_NATIVE_COLLECTIVE = re.compile(r"c10d::|gloo::|nccl", re.IGNORECASE)
# Frames that say nothing about where a rank is: babysit's own worker API (a rank may or may
# not be inside ``run.batches`` depending on where it stopped), threading and import machinery.
# Ours are anything under the installed package, or the rank room as py-spy may name it relative
# to the repository (an editable install); a user's own `supervisor/` folder is not ours.
_NOISE = re.compile(r"(^|/)babysit/(?:[^/]+/)*[^/]+\.py$|(^|/)supervisor/rank/[^/]+\.py$"
                    r"|(^|/)threading\.py$|^<frozen ")

_THREAD_LINE = re.compile(r'^Thread (?P<tid>0x[0-9a-fA-F]+|\d+) \((?P<status>[^)]*)\)'
                          r'(?:: "(?P<name>.*)")?\s*$')
# "    function (file:line)" for Python frames, "    symbol (library.so)" for native ones. The
# function is greedy so that names with parentheses keep them; the file is the last "(...)".
_FRAME_LINE = re.compile(r"^\s+(?P<func>.+) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)\s*$")


@dataclass(frozen=True)
class Frame:
    """One frame as py-spy prints it. ``file`` is package-relative (``torch/distributed/...``);
    ``line`` is None for a native frame, where ``file`` is the shared library."""

    function: str
    file: str
    line: int | None

    @property
    def native(self) -> bool:
        return self.line is None

    def __str__(self) -> str:
        return f"{self.function} ({self.file})" if self.line is None else \
            f"{self.function} ({self.file}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, innermost first. ``status`` is py-spy's: idle, active, active+gil."""

    tid: int
    name: str
    status: str
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class StackDump:
    """What ``py-spy dump`` saw in one rank. Exactly one of ``threads``/``error`` is meaningful:
    on failure ``error`` says what happened and ``hint`` what to do, and ``raw`` keeps whatever
    py-spy printed. ``elapsed_s`` is seconds from the start of the dump round to this answer."""

    rank: int
    pid: int
    raw: str = ""
    threads: tuple[ThreadStack, ...] = ()
    error: str | None = None
    hint: str | None = None
    elapsed_s: float = 0.0
    native: bool = False
    like: int | None = None
    """Set on a rank whose native frames were not read: the rank with the same Python stack
    whose native frames stand for its own (``deepen``)."""

    @property
    def main_thread(self) -> ThreadStack | None:
        """The interpreter's main thread: named MainThread, else the one whose id is the pid."""
        for thread in self.threads:
            if thread.name == "MainThread":
                return thread
        for thread in self.threads:
            if thread.tid == self.pid:
                return thread
        return self.threads[0] if self.threads else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the raw text (it goes to its own file)."""
        main = self.main_thread
        return {"rank": self.rank, "pid": self.pid, "error": self.error, "hint": self.hint,
                "elapsed_s": round(self.elapsed_s, 3), "native": self.native,
                **({"native_as_rank": self.like} if self.like is not None else {}),
                "threads": len(self.threads),
                "main_thread": [str(f) for f in main.frames] if main else []}


Rule = Literal["collective", "majority", "same", "none"]


@dataclass(frozen=True)
class StackVerdict:
    """Which ranks to blame for a hang, and why.

    ``suspects``: ranks named as the cause (empty when no rank stands out). ``waiting``: ranks
    seen inside a collective. ``rule``: what decided, one of "collective" (some ranks wait in a
    collective, the suspects are outside), "majority" (suspects differ from a strict majority),
    "same" (every rank is in the same place), "none" (no rule could tell). ``evidence``: each
    rank's innermost frames (at most ``EVIDENCE_FRAMES``), or its dump error."""

    suspects: tuple[int, ...]
    reason: str
    evidence: dict[int, list[str]] = field(default_factory=dict)
    waiting: tuple[int, ...] = ()
    rule: Rule = "none"

    def to_dict(self) -> dict[str, Any]:
        return {"suspects": list(self.suspects), "reason": self.reason, "rule": self.rule,
                "waiting": list(self.waiting),
                "evidence": {str(r): frames for r, frames in sorted(self.evidence.items())}}


class Diagnosis(NamedTuple):
    """Every rank's dump and the verdict on them: what ``diagnose`` returns, what a hang
    confirmation hands on, and what an incident folder keeps."""

    dumps: dict[int, StackDump]
    verdict: StackVerdict


# -- dumping (side effects) -----------------------------------------------------------------------


def find_py_spy() -> str | None:
    """py-spy next to this interpreter (the usual place in a virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def dump_stacks(pids: Mapping[int, int], timeout_s: float = 10.0, *, native: bool = False,
                py_spy: str | Path | None = None) -> dict[int, StackDump]:
    """Dump every rank's Python stacks with ``py-spy dump``; ``pids`` maps rank -> pid.

    All dumps start at once and share one deadline of ``timeout_s`` seconds, so eight ranks
    take the time of the slowest one. ``native`` adds C/C++ frames (slower; see the module
    docstring). ``py_spy`` is the executable to use (default: ``find_py_spy()``).
    Never raises for a missing py-spy, a refused ptrace, a vanished process or a timeout: that
    rank's ``StackDump`` carries ``error`` and a ``hint``. Blocks at most about ``timeout_s``.
    """
    exe = str(py_spy) if py_spy is not None else find_py_spy()
    if exe is None or not (Path(exe).is_file() and os.access(exe, os.X_OK)):
        where = f"at {exe}" if exe else "next to the Python interpreter or on PATH"
        return {rank: StackDump(rank, pid, error=f"py-spy not found {where}",
                                hint="install it where babysit runs: pip install py-spy")
                for rank, pid in pids.items()}
    # A short error text: the user's RUST_BACKTRACE=1 would append py-spy's own backtrace.
    env = {**os.environ, "RUST_BACKTRACE": "0"}
    command = [exe, "dump"] + (["--native"] if native else [])
    results: dict[int, StackDump] = {}
    running: dict[int, tuple[int, subprocess.Popen[bytes], IO[bytes], IO[bytes]]] = {}
    start = time.monotonic()
    deadline = start + timeout_s
    with ExitStack() as files:
        for rank, pid in pids.items():
            # Temporary files, not pipes: a pipe left unread while we wait for another rank
            # would block a py-spy with a big dump and eat into its timeout.
            out: IO[bytes] = files.enter_context(tempfile.TemporaryFile())
            err: IO[bytes] = files.enter_context(tempfile.TemporaryFile())
            try:
                proc = subprocess.Popen([*command, "--pid", str(pid)], stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, env=env)
            except OSError as exc:
                results[rank] = StackDump(rank, pid, error=f"could not run {exe}: {exc}",
                                          hint="check that py-spy is executable here")
                continue
            running[rank] = (pid, proc, out, err)
        for rank, (pid, proc, out, err) in running.items():
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # The kernel detaches ptrace when py-spy dies, so the rank is not left paused.
                proc.kill()
                proc.wait()
                code = None
            elapsed = time.monotonic() - start
            out.seek(0)
            err.seek(0)
            text = out.read().decode(errors="replace")
            errors = err.read().decode(errors="replace").strip()
            results[rank] = _result(rank, pid, code, text, errors, timeout_s, elapsed, native)
    return {rank: results[rank] for rank in pids}


def _result(rank: int, pid: int, code: int | None, text: str, errors: str, timeout_s: float,
            elapsed: float, native: bool) -> StackDump:
    if code is None:
        return StackDump(rank, pid, raw=text, elapsed_s=elapsed, native=native,
                         error=f"py-spy did not answer within {timeout_s:g} s",
                         hint=f"the process may be stuck in the kernel (state D): see "
                              f"/proc/{pid}/stack, or retry with a longer timeout")
    threads = parse_dump(text)
    if code == 0 and threads:
        return StackDump(rank, pid, raw=text, threads=threads, elapsed_s=elapsed, native=native)
    message = errors.splitlines()[0] if errors else f"py-spy exited with code {code}"
    return StackDump(rank, pid, raw=text + errors, error=message, hint=_hint(errors, pid),
                     elapsed_s=elapsed, native=native)


def _hint(errors: str, pid: int) -> str:
    lowered = errors.lower()
    if "permission" in lowered or "operation not permitted" in lowered:
        return ("ptrace was refused: run babysit as the same user as the training job, or as "
                "root, or allow it with: sysctl kernel.yama.ptrace_scope=0 (in a container: "
                "--cap-add SYS_PTRACE)")
    if "no such file" in lowered or "no such process" in lowered:
        return f"process {pid} is gone: it exited before its stack could be read"
    if "python version" in lowered:
        return f"process {pid} does not look like a Python interpreter"
    return f"run py-spy dump --pid {pid} by hand to see the full error"


def parse_dump(text: str) -> tuple[ThreadStack, ...]:
    """Threads and frames from ``py-spy dump``'s text (innermost frame first, as printed).
    Lines that are neither a thread header nor a frame (the process banner, locals) are
    skipped."""
    threads: list[ThreadStack] = []
    header: re.Match[str] | None = None
    frames: list[Frame] = []

    def flush() -> None:
        if header is not None:
            threads.append(ThreadStack(int(header["tid"], 0), header["name"] or "",
                                       header["status"], tuple(frames)))

    for line in text.splitlines():
        if (match := _THREAD_LINE.match(line)) is not None:
            flush()
            header, frames = match, []
        elif header is not None and (frame := _FRAME_LINE.match(line)) is not None:
            number = frame["line"]
            frames.append(Frame(frame["func"], frame["file"], int(number) if number else None))
    flush()
    return tuple(threads)


# -- judging (pure) -------------------------------------------------------------------------------


def collective_frame(frames: Iterable[Frame]) -> Frame | None:
    """The innermost frame showing that the thread is inside a torch.distributed collective or
    wait, or None. Python frames count when they are in ``torch/distributed/`` and named like a
    collective; native frames when they are in c10d, gloo or NCCL."""
    for frame in frames:
        if frame.native:
            if _NATIVE_COLLECTIVE.search(frame.function):
                return frame
        elif "torch/distributed/" in frame.file.replace("\\", "/") and \
                frame.function.rsplit(".", 1)[-1] in _COLLECTIVES:
            return frame
    return None


def outside_torch(dump: StackDump) -> bool:
    """The rank's main thread is in code of its own, not inside torch: its innermost meaningful
    Python frame is not in a ``torch/`` file. A busy rank there is working (computing, loading,
    writing) whatever its peers wait in, so no native pass is needed to judge it."""
    main = dump.main_thread
    if dump.error is not None or main is None:
        return False
    python = [f for f in _meaningful(main.frames) if not f.native]
    if not python:
        return False
    file = "/" + python[0].file.replace("\\", "/")
    return "/torch/" not in file


def _meaningful(frames: Iterable[Frame]) -> list[Frame]:
    return [f for f in frames if not _NOISE.search(f.file)]


def _signature(frames: Iterable[Frame]) -> tuple[str, ...]:
    # Native frames are left out: their symbols vary with the libc and unwinder, not the place.
    return tuple(f"{f.file}:{f.function}" for f in _meaningful(frames) if not f.native)


def _place(frames: list[Frame]) -> str:
    """Where a thread is, in a few words: its innermost meaningful Python frame."""
    python = [f for f in _meaningful(frames) if not f.native] or frames
    return str(python[0]) if python else "an empty stack"


def _evidence(frames: list[Frame]) -> list[str]:
    """The innermost Python frames, led by the native collective frame when there is one (the
    other native frames are libc and pybind11 plumbing)."""
    python = [f for f in _meaningful(frames) if not f.native]
    wait = collective_frame(frames)
    lead = [wait] if wait is not None and wait.native else []
    return [str(f) for f in [*lead, *python][:EVIDENCE_FRAMES]]


# Native waits a reader may not recognize by their C++ names.
_KNOWN_WAITS = (("c10d::Reducer::", "DDP's gradient all-reduce"),
                ("Work::wait", "a collective's wait()"))


def _describe_wait(frame: Frame) -> str:
    for marker, words in _KNOWN_WAITS:
        if marker in frame.function:
            return f"{words}, {frame}"
    return str(frame)


def _ranks(ranks: Iterable[int]) -> str:
    return said_ranks(ranks)


def odd_one_out(dumps: Mapping[int, StackDump]) -> StackVerdict:
    """Name the rank(s) a hang is waiting for, from every rank's main-thread stack (pure).

    Ranks inside a collective wait; ranks outside one are the suspects. When that does not
    split the ranks, those whose stack differs from a strict majority are. Ranks whose dump
    failed are left out of the judgment and named in the reason."""
    stacks = {r: list(d.main_thread.frames) for r, d in dumps.items()
              if d.error is None and d.main_thread is not None}
    evidence = {r: _evidence(frames) for r, frames in stacks.items()}
    missing = sorted(set(dumps) - set(stacks))
    for rank in missing:
        dump = dumps[rank]
        evidence[rank] = [f"no stack: {dump.error or 'no threads in the dump'}"]
    note = f" ({_ranks(missing)}: no stack, left out)" if missing else ""
    if not stacks:
        return StackVerdict((), f"no rank's stack could be read{note}", evidence)

    colls = {r: f for r, frames in stacks.items() if (f := collective_frame(frames)) is not None}
    waiting = tuple(sorted(colls))
    outside = sorted(set(stacks) - set(colls))
    if colls and outside:
        if len(outside) == 1:
            where = f"rank {outside[0]} is outside any collective, at {_place(stacks[outside[0]])}"
        else:
            where = f"{_ranks(outside)} are outside any collective (" + \
                "; ".join(f"rank {r} at {_place(stacks[r])}" for r in outside) + ")"
        in_ = "; ".join(sorted({_describe_wait(f) for f in colls.values()}))
        return StackVerdict(tuple(outside),
                       f"{where}, while {_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''}"
                       f" for {'it' if len(outside) == 1 else 'them'} in {in_}{note}",
                       evidence, waiting, "collective")

    signatures = {r: _signature(frames) for r, frames in stacks.items()}
    counts = Counter(signatures.values())
    if len(counts) == 1:
        inside = " (inside a collective)" if colls else ""
        first = min(stacks)
        return StackVerdict((), f"all ranks are in the same place{inside}: "
                           f"{_place(stacks[first])}; no rank stands out{note}",
                       evidence, waiting, "same")
    common, count = counts.most_common(1)[0]
    if count * 2 > len(stacks):
        odd = sorted(r for r, s in signatures.items() if s != common)
        others = [r for r in stacks if signatures[r] == common]
        where = "; ".join(f"rank {r} at {_place(stacks[r])}" for r in odd)
        return StackVerdict(tuple(odd),
                       f"{_ranks(odd)} {'differs' if len(odd) == 1 else 'differ'} from the "
                       f"other {count} ({where}; they are at {_place(stacks[others[0]])}){note}",
                       evidence, waiting, "majority")
    groups = "; ".join(f"{_ranks(r for r, s in signatures.items() if s == sig)} at "
                       f"{_place(stacks[next(r for r, s in signatures.items() if s == sig)])}"
                       for sig, _ in counts.most_common())
    return StackVerdict((), f"no rank stands out: no collective tells who waits for whom and no "
                       f"majority agrees ({groups}){note}", evidence, waiting, "none")


def diagnose(pids: Mapping[int, int], timeout_s: float = 10.0, *,
             py_spy: str | Path | None = None) -> Diagnosis:
    """Dump every rank (``pids``: rank -> pid) and judge. When the Python frames show no rank
    in a collective and the ranks differ (DDP's backward, ``work.wait()``), dump again with
    native frames and judge those; ranks whose native dump fails keep their Python dump.
    Takes about 0.1 s, or about a second more when native frames are needed; never raises."""
    dumps = dump_stacks(pids, timeout_s, py_spy=py_spy)
    return deepen(pids, dumps, odd_one_out(dumps), timeout_s, py_spy=py_spy)


SAMPLE_PER_PLACE = 2
"""How many idle ranks of each place (the same Python stack) ``deepen`` reads natively."""


def deepen(pids: Mapping[int, int], dumps: dict[int, StackDump], verdict: StackVerdict,
           timeout_s: float = 10.0, *, busy: Iterable[int] = (),
           py_spy: str | Path | None = None) -> Diagnosis:
    """``diagnose``'s second pass: when the Python frames of ``dumps`` show no rank in a
    collective and the ranks differ, read native frames and judge those.

    Only what the judgment needs is read: every ``busy`` rank (it may be computing where the
    others wait), and ``SAMPLE_PER_PLACE`` idle ranks of each place, a place being the ranks
    with one Python stack. The other idle ranks of a place take their sample's native frames
    (``StackDump.like``) when the sample agrees (all inside a collective, or all outside);
    when it does not, the whole place is read. A native read costs about a second of CPU per
    rank, so 24 ranks on 2 cores went from about 35 s to the time of a handful."""
    if verdict.waiting or verdict.rule == "same" or \
            all(d.error is not None for d in dumps.values()):
        return Diagnosis(dumps, verdict)
    places = _places(dumps)
    sample = {r for ranks in places.values() for r in ranks[:SAMPLE_PER_PLACE]}
    sample |= {r for r in busy if r in dumps}
    native = dump_stacks({r: pids[r] for r in sorted(sample)}, timeout_s, native=True,
                         py_spy=py_spy)
    rest = {r for ranks in places.values() if not _agree(ranks, native) for r in ranks}
    rest -= set(native)
    if rest:
        native |= dump_stacks({r: pids[r] for r in sorted(rest)}, timeout_s, native=True,
                              py_spy=py_spy)
    merged = {r: _native_or_own(r, dumps[r], native, places) for r in dumps}
    return Diagnosis(merged, odd_one_out(merged))


def _places(dumps: Mapping[int, StackDump]) -> dict[tuple[str, ...], list[int]]:
    """Readable ranks grouped by their main thread's Python signature, lowest rank first."""
    places: dict[tuple[str, ...], list[int]] = {}
    for rank, dump in sorted(dumps.items()):
        main = dump.main_thread
        if dump.error is None and main is not None:
            places.setdefault(_signature(main.frames), []).append(rank)
    return places


def _read(dump: StackDump | None) -> bool:
    return dump is not None and dump.error is None and dump.main_thread is not None


def _agree(ranks: list[int], native: Mapping[int, StackDump]) -> bool:
    """Whether the natively read ranks of one place agree on being inside a collective."""
    read = [native[r] for r in ranks if _read(native.get(r))]
    inside = {collective_frame(d.main_thread.frames) is not None  # type: ignore[union-attr]
              for d in read}
    return len(inside) <= 1


def _native_or_own(rank: int, own: StackDump, native: Mapping[int, StackDump],
                   places: Mapping[tuple[str, ...], list[int]]) -> StackDump:
    """This rank's native dump; else its place's first native dump, marked as borrowed; else
    its own Python dump."""
    mine = native.get(rank)
    if _read(mine):
        return mine  # type: ignore[return-value]
    place = next((ranks for ranks in places.values() if rank in ranks), [])
    model = next((native[r] for r in place if _read(native.get(r))), None)
    if model is None or mine is not None:
        return own  # read and failed, or nothing in its place was read: its Python stack
    note = (f"\n(native frames not read: rank {model.rank} has the same Python stack, and "
            f"its native frames stand for this rank's)\n")
    return dataclasses.replace(model, rank=rank, pid=own.pid, raw=own.raw + note,
                               like=model.rank, elapsed_s=own.elapsed_s)
