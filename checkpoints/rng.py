"""Every random stream a training step can draw from, captured and restored per rank.

Worker side: imports torch (and numpy) inside the functions so ``import checkpoints`` stays
torch-free. Resuming restores the exact streams, so a run stopped and resumed with nothing skipped
draws the same dropout masks, shuffles and augmentations as one that never stopped.
"""

from __future__ import annotations

import random
from typing import Any


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (every device, only if CUDA is already in use),
    Python ``random`` and numpy's legacy global generator (if numpy is installed)."""
    import torch

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": None,
        "numpy": None,
    }
    # Don't initialise CUDA just to read its RNG: a CPU-only job (or one that never touched the
    # GPU in this process) has no CUDA stream worth saving.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


_expected: tuple[int, Any] | None = None
"""The digest the streams should have at the next step's first training forward after the
last restore (``expected_at_forward``), and torch's CPU state as restored."""


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNG streams to ``state`` (from ``capture_rng`` on the same rank, or a
    mark's: ``checkpoints.mark``). Where ``state`` says what they were as the next step's first
    training forward began (``forward``, a ``Streams.digest``), that is kept for the resumed
    loop to check (``expected_at_forward``)."""
    import torch

    global _expected
    torch.set_rng_state(state["torch"])
    forward = state.get("forward")
    _expected = (forward, torch.get_rng_state()) if isinstance(forward, int) and forward \
        else None
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("numpy") is not None:
        import numpy as np

        np.random.set_state(state["numpy"])


def expected_at_forward() -> int | None:
    """What the last ``restore_rng`` said the streams would be as the next step's first
    training forward begins (a ``checkpoints.mark.Streams.digest``), once, right after the
    restore (``attach()``): None after the first call, where the restored state did not say,
    or where torch's stream moved since (a restore whose loop never asked, long ago)."""
    import torch

    global _expected
    expected, _expected = _expected, None
    if expected is None or not torch.equal(torch.get_rng_state(), expected[1]):
        return None
    return expected[0]
