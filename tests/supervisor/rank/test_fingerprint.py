"""The SDC fingerprints: replicas agree bit for bit, and any single flipped bit is seen."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from babysit.supervisor.rank.fingerprint import (
    COLUMNS,
    Fingerprinter,
    _checksum,
    param_digest,
    probe_digest,
)
from tests.conftest import ROOT

INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    # The first weight has 32 * 40 = 1280 elements: a COLUMNS-wide body and a tail.
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    return model.to(dtype)


def flip(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of one element in place, through an integer view of the storage."""
    ints = tensor.data.view(INT_OF_WIDTH[tensor.element_size()]).view(-1)
    top = 8 * tensor.element_size() - 1
    # 1 << top does not fit the signed type; -(1 << top) is the same bit pattern and does.
    mask = -(1 << bit) if bit == top and ints.dtype != torch.uint8 else 1 << bit
    ints[index : index + 1].bitwise_xor_(mask)


# Bits per dtype: lowest mantissa bits, the top mantissa bit, lowest and top exponent, sign.
BITS = {
    torch.float32: [0, 1, 12, 22, 23, 30, 31],
    torch.float64: [0, 1, 40, 51, 52, 62, 63],
    torch.bfloat16: [0, 1, 6, 7, 14, 15],
    torch.float16: [0, 1, 9, 10, 14, 15],
}


def test_identical_models_give_identical_digests() -> None:
    a, b = mlp(0), mlp(0)
    assert param_digest(a) == param_digest(b)
    assert Fingerprinter(10, a).digests() == Fingerprinter(10, b).digests()
    assert param_digest(mlp(1)) != param_digest(a)


@pytest.mark.parametrize("dtype", list(BITS))
def test_every_sampled_single_bit_flip_changes_the_param_digest(dtype: torch.dtype) -> None:
    model = mlp(0, dtype)
    clean = param_digest(model)
    weight, bias = model[0].weight, model[2].bias
    # First, last, a body/tail boundary of the first weight, and the last parameter.
    places = [(weight, 0), (weight, COLUMNS - 1), (weight, COLUMNS), (weight, weight.numel() - 1),
              (bias, bias.numel() - 1)]
    for tensor, index in places:
        for bit in BITS[dtype]:
            flip(tensor, index, bit)
            assert param_digest(model) != clean, (dtype, index, bit)
            flip(tensor, index, bit)
            assert param_digest(model) == clean


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_single_bit_flip_changes_the_param_digest(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(list(BITS)))
    model = mlp(0, dtype)
    clean = param_digest(model)
    params = list(model.parameters())
    tensor = params[data.draw(st.integers(0, len(params) - 1))]
    index = data.draw(st.integers(0, tensor.numel() - 1))
    bit = data.draw(st.integers(0, 8 * tensor.element_size() - 1))
    flip(tensor, index, bit)
    assert param_digest(model) != clean


def test_swapping_two_values_changes_the_param_digest() -> None:
    model = mlp(0)
    clean = param_digest(model)
    flat = model[0].weight.data.view(-1)
    for i, j in [(0, 1), (5, 1100), (COLUMNS, COLUMNS + 1)]:
        flat[[i, j]] = flat[[j, i]]
        assert param_digest(model) != clean, (i, j)
        flat[[i, j]] = flat[[j, i]]
    # Across parameters too: the positions run on through named_parameters order.
    w, b = model[0].weight.data.view(-1), model[0].bias.data
    w[0], b[0] = b[0].item(), w[0].item()
    assert param_digest(model) != clean


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_params_are_digested(dtype: torch.dtype) -> None:
    model = mlp(0, dtype)
    digest = param_digest(model)
    assert digest is not None
    assert digest == param_digest(mlp(0, dtype))
    # The same values in another dtype are other bits, hence another digest.
    assert digest != param_digest(mlp(0))


def test_memory_layout_does_not_matter() -> None:
    values = torch.randn(48, 40)
    contiguous = torch.nn.Module()
    contiguous.w = torch.nn.Parameter(values.clone())
    transposed = torch.nn.Module()
    transposed.w = torch.nn.Parameter(values.t().contiguous().t())
    assert not transposed.w.is_contiguous()
    assert param_digest(contiguous) == param_digest(transposed)


def test_checksum_is_the_weighted_sum_modulo_2_to_the_64() -> None:
    # Pins the arithmetic, wraparound included (float64 bit patterns overflow int64 products).
    for dtype, scale in [(torch.float64, 1e300), (torch.float32, 1.0), (torch.bfloat16, 1.0)]:
        for n in [1, COLUMNS, 2 * COLUMNS + 7]:
            x = (torch.randn(n, dtype=torch.float64) * scale).to(dtype)
            ints = x.view(INT_OF_WIDTH[x.element_size()]).tolist()
            for offset in [0, 99, 1 << 40]:
                expected = sum((2 * (offset + i) + 1) * v for i, v in enumerate(ints)) % (1 << 64)
                assert int(_checksum(x, offset)) % (1 << 64) == expected


def test_a_model_without_parameters_has_no_param_digest() -> None:
    model = torch.nn.ReLU()
    assert param_digest(model) is None
    assert set(Fingerprinter(5, model).digests()) == {"probe"}


def test_meta_parameters_have_no_param_digest() -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    assert param_digest(model) is None
    assert Fingerprinter(5, model).digests() == {"probe": probe_digest()}


def test_probe_is_stable_across_calls_and_processes() -> None:
    code = "from babysit.supervisor.rank.fingerprint import probe_digest; print(probe_digest())"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    digests = {probe_digest() for _ in range(100)}
    assert len(digests) == 1
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        assert out.strip() in digests


def test_probe_digest_is_the_fingerprinters() -> None:
    assert Fingerprinter(1).digests() == {"probe": probe_digest()}
    assert Fingerprinter(1, mlp(0)).digests() == {"params": param_digest(mlp(0)),
                                                   "probe": probe_digest("cpu")}


def test_due_every_n_steps() -> None:
    fp = Fingerprinter(100, mlp(0))
    assert [s for s in range(0, 501) if fp.due(s)] == [100, 200, 300, 400, 500]
    with pytest.raises(ValueError, match="positive number of steps"):
        Fingerprinter(0)


# -- sharded parameters -----------------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sharded_dtensor_params_have_no_param_digest(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    model = mlp(0)
    model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh,
                                                           [Shard(0)]))
    assert param_digest(model) is None
    assert set(Fingerprinter(5, model).digests()) == {"probe"}
    # Replicated DTensors are replicas: digested through their local tensor, like plain ones.
    model[0].weight = torch.nn.Parameter(distribute_tensor(mlp(0)[0].weight.detach(), mesh,
                                                           [Replicate()]))
    assert param_digest(model) == param_digest(mlp(0))


def test_fsdp_models_have_no_param_digest(one_rank_group: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    with pytest.warns(UserWarning, match="NO_SHARD"):
        fsdp1 = FullyShardedDataParallel(mlp(0), device_id=torch.device("cpu"))
    assert param_digest(fsdp1) is None
    assert param_digest(fully_shard(mlp(0))) is None
