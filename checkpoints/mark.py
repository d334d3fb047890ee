"""A rank's mark: where the step in progress started, kept where its node can read it after the
rank died.

Just-in-time state (``checkpoints/just_in_time.py``) is the model and optimizer of the last
completed step, written by the ranks that are still alive after a fault. Every rank also needs
its own random streams *as they were when that step started* (dropout masks, shuffles), and a
rank that died cannot hand them over. So at the start of every step each rank records them, with
the step, the data cursor and the LR scale, into a small file of its own in node-local shared
memory (``/dev/shm``): a memory-mapped write of a few KB, which outlives the process. The node's
babysitter copies a dead rank's file into the just-in-time checkpoint (``mark_<rank>.bin``) and
the resumed rank restores its streams from it.

The layout (little-endian)::

    header   magic "BABYMARK" | version u32 | cuda width u32 | seq u64 | step i64 | cursor i64 |
             samples i64 (-1: not counted) | lr_scale f64 | length u32 of each section below |
             forward u64 (version 2)
    torch    torch.get_rng_state() bytes                           at TORCH_AT
    cuda     each initialised device's generator state, in order   at CUDA_AT
    python   random's 625 state words, gauss_next flag and value   at PYTHON_AT
    numpy    the legacy global RandomState: 624 keys, pos, gauss    at NUMPY_AT

``seq`` is odd while a rank writes: a rank killed in the middle of its write leaves an odd
``seq`` and the mark reads as torn (its streams are then lost, and said so). The header is
torch-free; only ``rng`` needs torch. ``forward`` (version 2; version 1 is still read) is a
digest of the streams as the next step's first training forward began (0: not reached yet),
written into the mark then (``note``), which a resume checks its own first forward against
(``rank.boundary``).

The streams a mark records are those of the moment of its write, or of a snapshot taken
earlier (``Streams``): in a loop that draws the next step's batch inside the step, after its
last forward (nanoGPT's), the step's end is marked with the streams as they stood when that
forward ended, before the draw the script makes again on a resume (``rank.boundary``).

Capturing the streams costs about 15 us a step in a training loop (``benchmarks/mark_cost.py``):
torch's CPU state (5 KB) is copied every step, while Python's ``random`` and numpy's global
generator are re-read only when a cheap look at their position says they moved (a full read
costs 9 and 33 us, and most training loops never draw from them). The look reads the
generators' own memory; it is checked against their public state once per process and
replaced by the full read wherever that check fails.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"BABYMARK"
VERSION = 2
HEADER = struct.Struct("<8sIIQqqqdIIIIQ")
HEADER_V1 = struct.Struct("<8sIIQqqqdIIII")
"""Version 1's header: no ``forward`` digest."""
_FORWARD, _FORWARD_AT = struct.Struct("<Q"), HEADER_V1.size
"""The ``forward`` digest, last in the header (8-byte aligned)."""
TORCH_AT, CUDA_AT, PYTHON_AT, NUMPY_AT, SIZE = 4096, 12288, 16384, 20480, 24576
"""Section offsets and the file's size (torch's CPU state is 5056 bytes; a CUDA generator's 16)."""
PYTHON = struct.Struct("<625IBd")
"""Python's stream: its 624 state words, the index, whether a Gaussian is cached, its value."""
NUMPY = struct.Struct("<624IiBd")
"""numpy's: 624 keys, the position, whether a Gaussian is cached, its value."""
_TAIL = struct.Struct("<iBd")
"""What follows the 624 words in both (an index or a position, a flag and a Gaussian)."""
_MT_WORDS = 624


class MarkError(ValueError):
    """A mark file that cannot be read: absent, not a mark, or torn by a rank that died."""


@dataclass(frozen=True, slots=True)
class Mark:
    """Where a rank's step in progress started: the steps completed, the data cursor, the samples
    of the data stream at that cursor (None: not counted), the LR scale, and the raw sections."""

    step: int
    cursor: int
    samples: int | None
    lr_scale: float
    sections: tuple[bytes, bytes, bytes, bytes]
    """torch, cuda, python, numpy (empty where absent)."""
    cuda_width: int = 0
    """Bytes of one CUDA device's generator state in the cuda section."""
    forward: int = 0
    """The digest (``digest``) of the streams as the next step's first training forward
    began; 0 where it was not reached (or not noted)."""

    def rng(self) -> dict[str, Any]:
        """The random streams as ``checkpoints.rng.capture_rng`` returns them (torch needed),
        with ``forward`` where the mark has it (``restore_rng`` keeps it for the check)."""
        state = _rng_of(self.sections, self.cuda_width)
        if self.forward:
            state["forward"] = self.forward
        return state


def _rng_of(sections: tuple[bytes, bytes, bytes, bytes], cuda_width: int) -> dict[str, Any]:
    """Raw sections (torch, cuda, python, numpy) as ``capture_rng`` returns the streams."""
    import torch

    raw_torch, raw_cuda, raw_python, raw_numpy = sections
    state: dict[str, Any] = {
        "torch": torch.frombuffer(bytearray(raw_torch), dtype=torch.uint8),
        "python": None, "cuda": None, "numpy": None}
    if raw_cuda and cuda_width:
        state["cuda"] = [torch.frombuffer(bytearray(raw_cuda[i:i + cuda_width]), dtype=torch.uint8)
                         for i in range(0, len(raw_cuda), cuda_width)]
    if raw_python:
        *words, has_gauss, gauss = PYTHON.unpack(raw_python)
        state["python"] = (3, tuple(words), gauss if has_gauss else None)
    if raw_numpy:
        import numpy as np

        *keys, pos, has_gauss, gauss = NUMPY.unpack(raw_numpy)
        state["numpy"] = ("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, gauss)
    return state


def read(path: str | Path) -> Mark:
    """The mark in ``path``; raises ``MarkError`` when it is absent, foreign or torn."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise MarkError(f"no mark at {path}: {exc.strerror or exc}") from exc
    if len(data) < HEADER.size:
        raise MarkError(f"{path} is not a babysit mark ({len(data)} bytes)")
    magic, version = data[:8], int.from_bytes(data[8:12], "little")
    if magic != MAGIC or version not in (1, VERSION):
        raise MarkError(f"{path} is not a version-{VERSION} (or 1) babysit mark")
    forward = 0
    if version == 1:
        _, _, cuda_width, seq, step, cursor, samples, lr_scale, *lengths = \
            HEADER_V1.unpack_from(data)
    else:
        _, _, cuda_width, seq, step, cursor, samples, lr_scale, *lengths, forward = \
            HEADER.unpack_from(data)
    if seq % 2 or seq == 0:
        raise MarkError(f"{path} is torn: its rank died while writing it (or wrote none)")
    offsets = (TORCH_AT, CUDA_AT, PYTHON_AT, NUMPY_AT)
    sections = tuple(data[at:at + n] for at, n in zip(offsets, lengths, strict=True))
    return Mark(step, cursor, None if samples < 0 else samples, lr_scale,
                sections, cuda_width, forward)  # type: ignore[arg-type]


class Streams:
    """This process's random streams, taken into a buffer laid out as a mark's sections: a
    snapshot a mark is written from later (``MarkWriter.write(streams=...)``), a checkpoint's
    streams (``rng``), or a digest of them (``digest``).

    ``take`` costs about what a mark's write does (torch's CPU state copied every time,
    Python's and numpy's only when a look at their position says they moved since this
    snapshot's last take); nothing is allocated but torch's own copy of its state."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.buffer = bytearray(SIZE - TORCH_AT)
        """The sections at their offsets less ``TORCH_AT``."""
        self._view: Any = ctypes.c_char.from_buffer(self.buffer)
        self._torch_at = ctypes.addressof(self._view)
        self.lengths = [0, 0, 0, 0]
        self.cuda_width = 0
        self.python = _PythonLook()
        self.numpy = _NumpyLook()
        self.taken = False
        """Taken at least once."""

    def take(self) -> None:
        """The streams as they are now."""
        torch, b = self._torch, self.buffer
        state = torch.get_rng_state()
        ctypes.memmove(self._torch_at, state.data_ptr(), state.numel())  # 5 KB, no wrapper
        self.lengths[0] = state.numel()
        if torch.cuda.is_initialized():
            states = torch.cuda.get_rng_state_all()
            cuda = b"".join(bytes(t.numpy().data) for t in states)
            at = CUDA_AT - TORCH_AT
            b[at:at + len(cuda)] = cuda
            self.lengths[1], self.cuda_width = len(cuda), len(cuda) // max(1, len(states))
        if self.python.copy(b, PYTHON_AT - TORCH_AT):
            self.lengths[2] = PYTHON.size
        if self.numpy.copy(b, NUMPY_AT - TORCH_AT):
            self.lengths[3] = NUMPY.size
        self.taken = True

    def sections(self) -> tuple[bytes, bytes, bytes, bytes]:
        b = self.buffer
        return tuple(bytes(b[at - TORCH_AT:at - TORCH_AT + n]) for at, n in zip(
            (TORCH_AT, CUDA_AT, PYTHON_AT, NUMPY_AT), self.lengths, strict=True)
        )  # type: ignore[return-value]

    def rng(self) -> dict[str, Any]:
        """The streams taken, as ``checkpoints.rng.capture_rng`` returns them."""
        return _rng_of(self.sections(), self.cuda_width)

    def digest(self) -> int:
        """The streams now, taken, as a nonzero 64-bit digest, about 8 us: torch's CPU state's
        CRC-32, and one of the CUDA generators' and of Python's and numpy's looks (their
        position and two words). Equal streams give equal digests; a digest is a check, not
        a proof."""
        self.take()
        b = memoryview(self.buffer)
        cpu = zlib.crc32(b[:self.lengths[0]])
        at = CUDA_AT - TORCH_AT
        rest = zlib.crc32(b[at:at + self.lengths[1]])
        rest = zlib.crc32(repr((self.python.look(), self.numpy.look())).encode(), rest)
        return (rest << 32 | cpu) or 1


class MarkWriter:
    """One rank's mark file, memory-mapped; ``write`` once per step (rank side)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.path = path
        self._view: Any = ctypes.c_char.from_buffer(self._map)  # released at close
        self._torch_at = ctypes.addressof(self._view) + TORCH_AT
        self._seq = 0
        self._now = Streams()
        self._written = self._now
        """The snapshot the mark was last written from."""
        self._looks: tuple[Any, Any] = (None, None)
        """Python's and numpy's looks at that write (``moved``)."""
        import torch

        self._torch = torch

    def write(self, step: int, cursor: int, samples: int | None, lr_scale: float,
              streams: Streams | None = None) -> None:
        """Record this rank's streams, now (or those ``streams`` took), as the start of the
        step after ``step``."""
        if streams is None or not streams.taken:
            streams = self._now
            streams.take()
        m = self._map
        self._seq += 1  # odd: a reader that finds it so knows the write never finished
        m[16:24] = self._seq.to_bytes(8, "little")
        m[TORCH_AT:SIZE] = streams.buffer
        self._written = streams
        self._looks = (streams.python.seen, streams.numpy.seen)
        self._seq += 1
        HEADER.pack_into(m, 0, MAGIC, VERSION, streams.cuda_width, self._seq, step, cursor,
                         -1 if samples is None else samples, lr_scale, *streams.lengths, 0)

    def note(self, forward: int) -> None:
        """The digest (``Streams.digest``) of the streams as the next step's first training
        forward began, into the mark written last: one aligned 8-byte store, which a rank
        killed at any point leaves whole (the mark is not torn by it)."""
        if self._seq:
            _FORWARD.pack_into(self._map, _FORWARD_AT, forward)

    def moved(self) -> bool:
        """Whether a write now would record other streams than the last write did: True
        before the first. About 4 us where ``write`` costs about 15: torch's CPU state read
        and compared in place, each CUDA generator's read, Python's and numpy's by the look
        ``write`` takes (a stream that cannot be looked at cheaply counts as moved)."""
        if self._seq == 0:
            return True
        torch, m = self._torch, self._map
        state = torch.get_rng_state()
        n = state.numel()
        if n != self._written.lengths[0] or _memcmp(self._torch_at, state.data_ptr(), n):
            return True
        if torch.cuda.is_initialized():
            cuda = b"".join(bytes(t.numpy().data) for t in torch.cuda.get_rng_state_all())
            if len(cuda) != self._written.lengths[1] or m[CUDA_AT:CUDA_AT + len(cuda)] != cuda:
                return True
        python, numpy = self._looks
        return self._now.python.moved_from(python) or self._now.numpy.moved_from(numpy)

    def close(self) -> None:
        self._view = None  # the map cannot close while a ctypes view of it exists
        self._map.close()


_memcmp = ctypes.CDLL(None).memcmp  # libc's, in this process: 5 KB compared in place
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memcmp.restype = ctypes.c_int


class _PythonLook:
    """Python's global ``random`` stream, copied into a mark when it moved since the last copy.

    CPython keeps a ``Random`` as ``PyObject_HEAD; int index; uint32_t state[624]``: comparing
    the index and two words tells whether it drew since, and the words are copied straight from
    there (a ``getstate`` and its packing cost 15 us). The layout is checked once against
    ``getstate``; where it differs, every copy goes through ``getstate``."""

    def __init__(self) -> None:
        self._inst: Any = random._inst
        self._seen: tuple[int, int, int, Any] | None = None
        self._base = 0
        try:
            base = id(self._inst)
            words = random.getstate()[1]
            self._index = ctypes.c_int.from_address(base + 16)
            self._words = (ctypes.c_uint32 * _MT_WORDS).from_address(base + 20)
            if self._index.value == words[-1] and tuple(self._words) == words[:-1]:
                self._base = base
        except (ValueError, TypeError, IndexError):
            self._base = 0

    @property
    def seen(self) -> tuple[int, int, int, Any] | None:
        """The look at the last ``copy`` (None: not copied, or not lookable)."""
        return self._seen

    def look(self) -> tuple[Any, ...]:
        """The stream's position and two words now (its whole state where it cannot be looked
        at cheaply)."""
        if not self._base:
            return self._inst.getstate()  # type: ignore[no-any-return]
        return (self._index.value, self._words[0], self._words[_MT_WORDS - 1],
                self._inst.gauss_next)

    def moved_from(self, seen: tuple[int, int, int, Any] | None) -> bool:
        """Whether the stream moved from the look ``seen`` (True where it cannot be looked at,
        or ``seen`` is None)."""
        if not self._base or seen is None:
            return True
        return self.look() != seen

    def copy(self, into: mmap.mmap | bytearray, at: int) -> bool:
        """Write the stream's state at ``at`` if it moved; True when written."""
        gauss = self._inst.gauss_next
        if not self._base:
            _, words, gauss = self._inst.getstate()
            PYTHON.pack_into(into, at, *words, gauss is not None, gauss or 0.0)
            return True
        look = (self._index.value, self._words[0], self._words[_MT_WORDS - 1], gauss)
        if look == self._seen:
            return False
        self._seen = look
        into[at:at + 4 * _MT_WORDS] = bytes(self._words)
        _TAIL.pack_into(into, at + 4 * _MT_WORDS, look[0], gauss is not None, gauss or 0.0)
        return True


class _NumpyLook:
    """numpy's legacy global ``RandomState`` (``np.random.rand``...), copied into a mark when it
    moved. Its MT19937 keeps ``uint32_t key[624]; int pos``, which the bit generator's ctypes
    interface points at: the position and two keys tell whether it drew (a full ``get_state``
    costs 33 us, and is paid only when it did). No numpy: nothing to keep."""

    def __init__(self) -> None:
        self._state: Any = None
        self._seen: tuple[int, int, int] | None = None
        self._view: Any = None
        try:
            import numpy as np

            self._state = np.random.mtrand._rand
            address = self._state._bit_generator.ctypes.state_address
            keys = (ctypes.c_uint32 * _MT_WORDS).from_address(address)
            pos = ctypes.c_int.from_address(address + 4 * _MT_WORDS)
            _, want, want_pos, *_ = self._state.get_state()
            if pos.value == want_pos and list(keys) == want.tolist():
                self._view = (keys, pos)
        except (ImportError, AttributeError, ValueError, TypeError):
            self._view = None

    @property
    def seen(self) -> tuple[int, int, int] | None:
        """The look at the last ``copy`` (None: not copied, or not lookable)."""
        return self._seen

    def look(self) -> tuple[Any, ...] | None:
        """The generator's position and two keys now (its whole state where it cannot be
        looked at cheaply; None without numpy)."""
        if self._state is None:
            return None
        if self._view is None:
            _, keys, pos, has_gauss, gauss = self._state.get_state()
            return (keys.tobytes(), pos, has_gauss, gauss)
        keys, pos = self._view
        return (pos.value, keys[0], keys[_MT_WORDS - 1])

    def moved_from(self, seen: tuple[int, int, int] | None) -> bool:
        """Whether the generator moved from the look ``seen`` (no numpy: never; True where it
        cannot be looked at, or ``seen`` is None)."""
        if self._state is None:
            return False
        if self._view is None or seen is None:
            return True
        return self.look() != seen

    def copy(self, into: mmap.mmap | bytearray, at: int) -> bool:
        """Write the generator's state at ``at`` if it moved; True when written."""
        if self._state is None:
            return False
        if self._view is not None:
            keys, pos = self._view
            look = (pos.value, keys[0], keys[_MT_WORDS - 1])
            if look == self._seen:
                return False
            self._seen = look
        _, keys_now, pos_now, has_gauss, gauss = self._state.get_state()
        into[at:at + 4 * _MT_WORDS] = keys_now.astype("<u4").tobytes()
        _TAIL.pack_into(into, at + 4 * _MT_WORDS, pos_now, has_gauss, gauss)
        return True
