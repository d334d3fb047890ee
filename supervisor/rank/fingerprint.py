"""Digests that must agree across ranks, to catch a device that silently computes wrong numbers.

Silent data corruption (a flipped bit in HBM, a faulty ALU) raises no error: the job keeps
training on wrong numbers. In a data-parallel job every rank holds the same parameters after
each optimizer step and computes the same fixed probe, so the rank whose digest disagrees with
its peers at the same step is the faulty one. The worker sends the digests; the supervisor
compares them. Two digests:

- ``param_digest(model)``: a bit-exact checksum of the parameters. Any change confined to one
  element (every single-bit flip in particular) changes it, with certainty, not merely with high
  probability; swapping two elements changes it too (see ``_checksum`` for the argument).
- ``probe_digest(device)``: a fixed seeded computation (matmuls and ``tanh``) on the device,
  which catches a device whose arithmetic is wrong even before the error reaches the weights.

Calling rules:

- Call ``Fingerprinter.digests()`` at the same step on every rank, after the optimizer step
  (the parameters are then identical across replicas). It synchronises the device once: the
  digests are reduced to scalars on the device and copied to the host together.
- ``param_digest`` returns None where parameters are not replicated: DTensor parameters with a
  Shard or Partial placement (FSDP2 ``fully_shard``, tensor parallelism) and FSDP1
  ``FullyShardedDataParallel`` models (whatever the sharding strategy, conservatively) hold a
  different shard on each rank, so their checksums differ by design and a comparison would
  name an innocent rank. It also returns None for a model with no parameters (nothing to
  compare) and for parameters on the ``meta`` device.
  It cannot see parallelism done with plain tensors (Megatron-style tensor or pipeline
  parallelism): there only ranks holding the same shard may be compared, which is the
  supervisor's business.
- A flip in a low mantissa bit can heal: the next optimizer update, identical on every rank,
  may round the difference away once the weight's exponent grows (seen with the lowest bit of a
  float32 weight within one step). Check often enough, or accept missing such harmless flips.
- Buffers are left out: DDP's running statistics are updated by each rank's own batch and are
  only broadcast at the next forward, so they legitimately differ between ranks at a step end.
- The probe is comparable only between devices of the same kind with the same math settings
  (TF32, thread count on CPU): an H100 and an A100 may round differently. On a healthy device it
  gives the same digest on every call and in every process.

Cost, measured on a 2-core CPU (torch 2.13, medians of 200 calls, the machine shared with other
work): ``param_digest`` of a 1.03M-parameter float32 MLP 0.6 ms with 2 threads, 0.8-1.3 ms with
one; ``probe_digest`` 1.4-2.2 ms; ``Fingerprinter.digests()`` (both) 2.4-3.7 ms. On the CPU the
widening int32 -> int64 reductions run at about 7 ns per element once the parameters no longer
fit in cache: a 25M-parameter model takes 180 ms. On a GPU the same reductions widen as they
load, so the parameter digest is two memory-bound reads of the parameters with temporaries of
only rows + COLUMNS int64s per parameter; not measured here (no GPU).

Imports: torch is imported inside the functions, so importing this module costs nothing and the
supervisor (which never imports torch) may import it for its names.
"""

from __future__ import annotations

import hashlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

COLUMNS = 1024
"""Parameters are digested as matrices of this many columns (see ``_checksum``)."""

PROBE_SIZE = 256
PROBE_SEED = 20240611
PROBE_LAYERS = 3

_MASK64 = (1 << 64) - 1


def param_digest(model: Any) -> str | None:
    """The digest of ``model``'s parameters, or None where it is not comparable across ranks.

    The checksum runs on the parameters' device; only one int64 scalar reaches the host.
    Parameters are taken in ``named_parameters()`` order, each in logical (row-major) order, so
    two replicas with the same values give the same digest whatever their memory layout. The
    digest reads ``SSSSSSSS-CCCCCCCCCCCCCCCC``: a hash of the parameters' names, shapes and
    dtypes, then the 64-bit checksum of their values.
    """
    total = _param_checksum(model)
    return None if total is None else _format(int(total.item()), _structure(model))


def local_digest(model: Any) -> str | None:
    """This rank's own parameters, its shards where they are sharded, bit-exact: for comparing
    one rank with itself over time (did the restore take?), never with another rank. None for
    a model with no parameters, or with ``meta`` ones."""
    total = _param_checksum(model, shards=True)
    return None if total is None else _format(int(total.item()), _structure(model))


def probe_digest(device: Any = None) -> str:
    """The digest of a fixed seeded computation on ``device`` (CPU when None)."""
    return _hex(int(_probe_checksum(device).item()))


class Fingerprinter:
    """Decides when to fingerprint and computes the digests for one rank.

    ``every_steps``: fingerprint at steps ``every_steps``, ``2 * every_steps``, ... (steps
    completed). ``device``: where the probe runs; default the device of the model's first
    parameter, else CPU. The constructor touches no device.

    Use from the training step, on every rank::

        if fp.due(step):
            send("fingerprint", step=step, digests=fp.digests())
    """

    def __init__(self, every_steps: int, model: Any = None, device: Any = None) -> None:
        if every_steps < 1:
            raise ValueError(f"fingerprint every_steps must be a positive number of steps, "
                             f"got {every_steps}; leave fingerprinting off to disable it")
        self.every_steps = every_steps
        self.model = model
        self.device = device

    def due(self, step: int) -> bool:
        """True at the steps where every rank should send its digests."""
        return step > 0 and step % self.every_steps == 0

    def digests(self, model: Any = None) -> dict[str, str]:
        """``{"params": ..., "probe": ...}``, ``"params"`` absent where ``param_digest`` would
        give None. ``model`` defaults to the constructor's. Synchronises the device once."""
        import torch

        model = self.model if model is None else model
        device = self.device
        if device is None:
            device = _first_device(model) if model is not None else None
        params = _param_checksum(model) if model is not None else None
        probe = _probe_checksum(device)
        if params is None:
            return {"probe": _hex(int(probe.item()))}
        # One device-to-host copy for both scalars: a single synchronisation.
        both = torch.stack([params.to(probe.device), probe]).tolist()
        return {"params": _format(both[0], _structure(model)), "probe": _hex(both[1])}


# -- the integer checksum ---------------------------------------------------------------------


def _checksum(flat: torch.Tensor, offset: int) -> torch.Tensor:
    """sum_i (2 * (offset + i) + 1) * bits_i over a 1-D tensor, modulo 2**64, as an int64 scalar.

    ``bits_i`` is element i's storage read as a signed integer of its own width (int16 for
    bfloat16/float16, int32 for float32, int64 for float64, uint8 for 1-byte types), widened to
    int64. Why this detects what it must:

    - Integer addition modulo 2**64 is associative and commutative, so the result does not depend
      on how the device splits the reduction: identical bits give an identical sum on any
      device, and products and sums that overflow wrap the same way on CPU and CUDA (two's
      complement; signed and unsigned products agree in their low 64 bits).
    - A change confined to element i changes bits_i by some d with 0 < |d| < 2**64; its weight
      is odd, hence invertible modulo 2**64, so the sum changes by weight * d != 0 (mod 2**64).
      Every single-bit flip, sign and exponent bits included, is therefore caught.
    - Swapping elements i and j changes the sum by 2 * (i - j) * (bits_j - bits_i), which is
      non-zero unless the values are equal, as long as |i - j| * |bits_j - bits_i| < 2**63:
      always for 32-bit types within 2**31 positions of each other, 16-bit within 2**47.

    It is computed without a temporary the size of the tensor (GPU memory is scarce): viewed as
    a (rows, COLUMNS) matrix, sum (2(offset + r*COLUMNS + c) + 1) * b[r, c] equals
    sum_r (2(offset + r*COLUMNS) + 1) * rowsum_r + sum_c 2c * colsum_c, and the row and column
    sums are two reductions that widen to int64 as they load. The same number modulo 2**64.
    """
    import torch

    i64 = torch.int64
    device = flat.device
    ints = _as_ints(flat)
    body = ints.numel() - ints.numel() % COLUMNS
    total = torch.zeros((), dtype=i64, device=device)
    if body:
        matrix = ints[:body].view(-1, COLUMNS)
        row_weights = torch.arange(matrix.shape[0], dtype=i64, device=device)
        row_weights.mul_(2 * COLUMNS).add_(2 * offset + 1)
        col_weights = torch.arange(0, 2 * COLUMNS, 2, dtype=i64, device=device)
        total += row_weights.mul_(matrix.sum(1, dtype=i64)).sum()
        total += col_weights.mul_(matrix.sum(0, dtype=i64)).sum()
    tail = ints[body:]
    if tail.numel():
        first = 2 * (offset + body) + 1
        weights = torch.arange(first, first + 2 * tail.numel(), 2, dtype=i64, device=device)
        total += weights.mul_(tail).sum()
    return total


def _as_ints(flat: torch.Tensor) -> torch.Tensor:
    """``flat``'s storage as integers of its element width (no copy). Wider types (complex128)
    are read as twice as many int64s."""
    import torch

    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(flat.element_size(), torch.int64)
    return flat.view(dtype)


def _param_checksum(model: Any, shards: bool = False) -> torch.Tensor | None:
    """The parameters' checksum as an int64 scalar on the first parameter's device, or None
    (sharded parameters give None unless ``shards``: then the local shards are summed)."""
    if not shards and _sharded(model):
        return None
    total: torch.Tensor | None = None
    offset = 0
    for _, param in model.named_parameters():
        tensor = _local_replica(param)
        if tensor.is_meta:
            return None
        flat = tensor.detach().reshape(-1)
        part = _checksum(flat, offset)
        offset += flat.numel()
        total = part if total is None else total + part.to(total.device)
    return total


def _structure(model: Any) -> str:
    """8 hex digits naming the parameters' names, shapes and dtypes, so that two ranks with
    different models never compare equal by accident."""
    text = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters())
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def _format(checksum: int, structure: str) -> str:
    return f"{structure}-{_hex(checksum)}"


def _hex(checksum: int) -> str:
    """The int64 checksum as 16 hex digits of its unsigned value."""
    return f"{checksum & _MASK64:016x}"


def _first_device(model: Any) -> Any:
    """The first parameter's device; None (the CPU) without parameters or for ``meta`` ones."""
    for param in model.parameters():
        return None if param.is_meta else param.device
    return None


# -- sharding ---------------------------------------------------------------------------------


def _sharded(model: Any) -> bool:
    """True when some rank holds a shard rather than a replica of the parameters.

    A DTensor or an FSDP module can only exist once its module was imported, so the modules are
    looked up in ``sys.modules`` rather than imported: checking costs nothing for a DDP job.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        wrappers = tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule")
                         if hasattr(fsdp, name))
        if wrappers and any(isinstance(module, wrappers) for module in model.modules()):
            return True
    dtensor = _dtensor_type()
    if dtensor is None:
        return False
    return any(isinstance(p, dtensor) and not all(pl.is_replicate() for pl in p.placements)
               for p in model.parameters())


def _dtensor_type() -> Any:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _local_replica(param: Any) -> Any:
    """A DTensor's local tensor (for a replicated one the full value); any other tensor as it
    is."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(param, dtensor):
        return param.to_local()
    return param


# -- the arithmetic probe ---------------------------------------------------------------------


def _probe_checksum(device: Any) -> torch.Tensor:
    """The checksum of ``PROBE_LAYERS`` rounds of ``tanh(x @ w)`` on seeded 256x256 float32
    inputs, drawn on the CPU with a constant seed (the same on every rank) and moved over."""
    import torch

    gen = torch.Generator().manual_seed(PROBE_SEED)
    x = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen)
    # Scaled so tanh stays in its curved range rather than saturating at +-1.
    w = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen) / PROBE_SIZE**0.5
    if device is not None and torch.device(device).type == "cuda":
        # A copy from pageable memory would synchronise the stream; from pinned memory it does
        # not, which keeps the whole check at one synchronisation.
        x = x.pin_memory().to(device, non_blocking=True)
        w = w.pin_memory().to(device, non_blocking=True)
    elif device is not None:
        x, w = x.to(device), w.to(device)
    for _ in range(PROBE_LAYERS):
        x = torch.tanh(x @ w)
    return _checksum(x.reshape(-1), 0)
