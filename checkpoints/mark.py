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
             samples i64 (-1: not counted) | lr_scale f64 | length u32 of each section below
    torch    torch.get_rng_state() bytes                           at TORCH_AT
    cuda     each initialised device's generator state, in order   at CUDA_AT
    python   random's 625 state words, gauss_next flag and value   at PYTHON_AT
    numpy    the legacy global RandomState: 624 keys, pos, gauss    at NUMPY_AT

``seq`` is odd while a rank writes: a rank killed in the middle of its write leaves an odd
``seq`` and the mark reads as torn (its streams are then lost, and said so). The header is
torch-free; only ``rng`` needs torch.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"BABYMARK"
VERSION = 1
HEADER = struct.Struct("<8sIIQqqqdIIII")
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

    def rng(self) -> dict[str, Any]:
        """The random streams as ``checkpoints.rng.capture_rng`` returns them (torch needed)."""
        import torch

        raw_torch, raw_cuda, raw_python, raw_numpy = self.sections
        state: dict[str, Any] = {
            "torch": torch.frombuffer(bytearray(raw_torch), dtype=torch.uint8),
            "python": None, "cuda": None, "numpy": None}
        if raw_cuda and self.cuda_width:
            width = self.cuda_width
            state["cuda"] = [torch.frombuffer(bytearray(raw_cuda[i:i + width]), dtype=torch.uint8)
                             for i in range(0, len(raw_cuda), width)]
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
    magic, version, cuda_width, seq, step, cursor, samples, lr_scale, *lengths = \
        HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise MarkError(f"{path} is not a version-{VERSION} babysit mark")
    if seq % 2 or seq == 0:
        raise MarkError(f"{path} is torn: its rank died while writing it (or wrote none)")
    offsets = (TORCH_AT, CUDA_AT, PYTHON_AT, NUMPY_AT)
    sections = tuple(data[at:at + n] for at, n in zip(offsets, lengths, strict=True))
    return Mark(step, cursor, None if samples < 0 else samples, lr_scale,
                sections, cuda_width)  # type: ignore[arg-type]


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
        self._lengths = [0, 0, 0, 0]
        self._cuda_width = 0
        self._python = _PythonLook()
        self._numpy = _NumpyLook()
        import torch

        self._torch = torch

    def write(self, step: int, cursor: int, samples: int | None, lr_scale: float) -> None:
        """Record this rank's streams, now, as the start of the step after ``step``."""
        torch, m = self._torch, self._map
        self._seq += 1  # odd: a reader that finds it so knows the write never finished
        m[16:24] = self._seq.to_bytes(8, "little")
        state = torch.get_rng_state()
        ctypes.memmove(self._torch_at, state.data_ptr(), state.numel())  # 5 KB, no wrapper
        self._lengths[0] = state.numel()
        if torch.cuda.is_initialized():
            states = torch.cuda.get_rng_state_all()
            cuda = b"".join(bytes(t.numpy().data) for t in states)
            m[CUDA_AT:CUDA_AT + len(cuda)] = cuda
            self._lengths[1], self._cuda_width = len(cuda), len(cuda) // max(1, len(states))
        if self._python.copy(m, PYTHON_AT):
            self._lengths[2] = PYTHON.size
        if self._numpy.copy(m, NUMPY_AT):
            self._lengths[3] = NUMPY.size
        self._seq += 1
        HEADER.pack_into(m, 0, MAGIC, VERSION, self._cuda_width, self._seq, step, cursor,
                         -1 if samples is None else samples, lr_scale, *self._lengths)

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
        if n != self._lengths[0] or _memcmp(self._torch_at, state.data_ptr(), n):
            return True
        if torch.cuda.is_initialized():
            cuda = b"".join(bytes(t.numpy().data) for t in torch.cuda.get_rng_state_all())
            if len(cuda) != self._lengths[1] or m[CUDA_AT:CUDA_AT + len(cuda)] != cuda:
                return True
        return self._python.moved() or self._numpy.moved()

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

    def moved(self) -> bool:
        """Whether the stream moved since the last ``copy`` (True where it cannot be looked
        at)."""
        if not self._base or self._seen is None:
            return True
        return (self._index.value, self._words[0], self._words[_MT_WORDS - 1],
                self._inst.gauss_next) != self._seen

    def copy(self, into: mmap.mmap, at: int) -> bool:
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

    def moved(self) -> bool:
        """Whether the generator moved since the last ``copy`` (no numpy: never; True where
        it cannot be looked at)."""
        if self._state is None:
            return False
        if self._view is None or self._seen is None:
            return True
        keys, pos = self._view
        return (pos.value, keys[0], keys[_MT_WORDS - 1]) != self._seen

    def copy(self, into: mmap.mmap, at: int) -> bool:
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
