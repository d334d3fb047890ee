"""The silent-data-corruption fingerprint computed on the GPU: the parameter digest is the same
whichever device holds the values (it checksums their bits), catches one flipped bit there, and
the arithmetic probe gives one answer on a healthy device, every time."""

from __future__ import annotations

import pytest
import torch

from babysit.supervisor.rank.fingerprint import Fingerprinter, param_digest, probe_digest

pytestmark = pytest.mark.gpu


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64))


def test_the_parameter_digest_on_the_gpu_matches_the_cpus_and_sees_one_bit() -> None:
    on_cpu = model()
    on_gpu = model().cuda()
    assert param_digest(on_gpu) == param_digest(on_cpu)
    weight = on_gpu[0].weight
    weight.data.view(torch.int32).view(-1)[7:8].bitwise_xor_(1 << 3)  # one low mantissa bit
    assert param_digest(on_gpu) != param_digest(on_cpu)


def test_the_probe_runs_on_the_device_and_is_stable() -> None:
    fp = Fingerprinter(every_steps=1, model=model().cuda())
    first = fp.digests()
    assert set(first) == {"params", "probe"}
    assert all(fp.digests() == first for _ in range(20))
    assert probe_digest("cuda") == first["probe"]
