"""A rank's own compute: its model's training forward time (``rank/forward_clock.py``)."""

from __future__ import annotations

import time

import torch

from babysit.supervisor.rank.forward_clock import forward_clock


class Slow(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def test_training_forwards_add_up_and_an_eval_under_no_grad_is_not_counted() -> None:
    model = Slow(0.02)
    clock = forward_clock(model)
    assert clock is not None
    assert clock.take() is None  # nothing timed yet
    x = torch.ones(2, 4)
    for _ in range(3):  # gradient accumulation: three forwards in one step
        model(x).sum().backward()
    with torch.no_grad():
        model(x)  # an eval between steps
    taken = clock.take()
    assert taken is not None and 0.06 <= taken < 0.5
    with torch.no_grad():
        model(x)
    assert clock.take() is None
    clock.remove()
    model(x)
    assert clock.take() is None  # the hooks are gone


def test_something_that_is_not_a_module_gets_no_clock() -> None:
    assert forward_clock(None) is None
    assert forward_clock(object()) is None


def test_a_compiled_model_is_timed_and_its_graph_holds_no_clock() -> None:
    """``torch.compile`` (dynamo, its eager backend: no code generated) runs the clock's hooks
    as plain Python around the model's graph."""
    import torch._dynamo

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    clock = forward_clock(model)
    assert clock is not None
    compiled = torch.compile(model, backend="eager")
    x = torch.ones(2, 4)
    for _ in range(3):
        compiled(x).sum().backward()
    taken = clock.take()
    assert taken is not None and taken > 0
    clock.remove()
