"""Stdout mode's parser, on lines as the real tools print them."""

from __future__ import annotations

import math

import pytest

from babysit.supervisor.node.progress_lines import (
    ProgressParser,
    compile_pattern,
    parse_line,
)

# (printed line, step, loss, grad_norm, lr, step_time in seconds)
RECOGNISED = [
    # nanoGPT train.py, with its first-iteration MFU placeholder
    ("iter 0: loss 10.9864, time 29366.60ms, mfu -100.00%", 0, 10.9864, None, None, 29.3666),
    ("iter 120: loss 3.1234, time 45.67ms, mfu 12.34%", 120, 3.1234, None, None, 0.04567),
    ("iter 7: loss nan, time 45.00ms, mfu 1.00%", 7, math.nan, None, None, 0.045),
    ("{'loss': nan, 'grad_norm': inf, 'epoch': 0.5}", None, math.nan, math.inf, None, None),
    # Hugging Face Trainer, old (numbers) and new (strings) formats
    ("{'loss': 2.0836, 'grad_norm': 1.4527, 'learning_rate': 4.8e-05, 'epoch': 0.06}",
     None, 2.0836, 1.4527, 4.8e-05, None),
    ("{'loss': '2.084', 'grad_norm': '1.453', 'learning_rate': '4.8e-05', 'epoch': '0.06'}",
     None, 2.084, 1.453, 4.8e-05, None),
    ("{'loss': 1.5, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 1.0}",
     None, 1.5, None, 1e-05, None),
    # Lightning's progress bar: batch 32 of 64 in epoch 1 is global batch 96
    ("Epoch 1:  50%|█████     | 32/64 [00:01<00:01, 25.60it/s, v_num=0, train_loss=2.310]",
     96, 2.31, None, None, None),
    ("Epoch 0:  12%|█▎        | 8/? [00:00<00:00, 25.60it/s, loss=4.5, v_num=3]",
     8, 4.5, None, None, None),
    # torchtitan, colours and logger prefix included
    ("[titan] 2025-03-01 12:00:00,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.1234"
     "  \x1b[33mgrad_norm:  1.2345  \x1b[38;2;180;60;0mmemory:  1.23GiB(1.56%)  \x1b[34mtps: "
     "1,234  \x1b[36mtflops: 0.12  \x1b[35mmfu: 0.01%\x1b[39m", 1, 8.1234, 1.2345, None, None),
    ("step: 30  loss:  5.5000  memory:  1.23GiB(1.56%)  tps: 9,876", 30, 5.5, None, None, None),
    # plain spellings
    ("step 12 loss 2.5", 12, 2.5, None, None, None),
    ("Step 12 | loss: 2.5 | lr: 3e-4 | grad_norm: 0.9", 12, 2.5, 0.9, 3e-4, None),
    ("step=12 loss=2.5", 12, 2.5, None, None, None),
    ("step 5/100, loss = 1.23, lr 0.001", 5, 1.23, None, 0.001, None),
    ("2025-01-01 INFO step 40 train_loss 0.75", 40, 0.75, None, None, None),
]

IGNORED = [
    "",
    "Saving checkpoint at step 100",
    "number of parameters: 10.65M",
    "step 250: train loss 1.9012, val loss 2.0034",  # nanoGPT's evaluation estimate
    "{'eval_loss': 1.9, 'eval_runtime': 0.5, 'epoch': 1.0}",
    "{'train_runtime': 10.2, 'train_samples_per_second': 99.0, 'train_loss': 2.1, 'epoch': 3.0}",
    "loss_scale 65536 at step 3",
    "Traceback (most recent call last):",
    "{'loss': [1, 2]}",
    "{'loss': 2.0, __import__('os')}",
]


@pytest.mark.parametrize(("text", "step", "loss", "grad", "lr", "step_time"), RECOGNISED)
def test_recognised_lines(text: str, step: int | None, loss: float, grad: float | None,
                          lr: float | None, step_time: float | None) -> None:
    line = parse_line(text)
    assert line is not None, text
    assert line.step == step
    assert line.loss == pytest.approx(loss, nan_ok=True)
    if grad is None:
        assert line.grad_norm is None or math.isnan(line.grad_norm)
    else:
        assert line.grad_norm == pytest.approx(grad)
    assert line.lr == (pytest.approx(lr) if lr is not None else None)
    assert line.step_time == (pytest.approx(step_time) if step_time is not None else None)


@pytest.mark.parametrize("text", IGNORED)
def test_lines_that_are_not_progress(text: str) -> None:
    assert parse_line(text) is None


def test_a_redrawn_progress_bar_is_read_from_its_newest_state() -> None:
    bar = ("Epoch 0:   0%|          | 0/10 [00:00<?, ?it/s]\rEpoch 0:  10%|█         | 1/10 "
           "[00:00<00:01, 9.1it/s, train_loss=3.0]\rEpoch 0:  20%|██        | 2/10 "
           "[00:00<00:01, 9.1it/s, train_loss=2.5]")
    line = parse_line(bar)
    assert line is not None and (line.step, line.loss) == (2, 2.5)


def test_custom_pattern_replaces_the_built_in_ones() -> None:
    pattern = compile_pattern(r"it=(?P<step>\d+) L=(?P<loss>\S+) dt=(?P<step_time_ms>\S+)ms")
    line = parse_line("it=7 L=0.25 dt=120ms", pattern)
    assert line is not None and (line.step, line.loss, line.step_time) == (7, 0.25, 0.12)
    assert parse_line("iter 7: loss 0.25", pattern) is None


@pytest.mark.parametrize(("pattern", "says"), [
    (r"step (\d+", "not a valid regular expression"),
    (r"step (?P<step>\d+)", "named group for the loss"),
    (r"(?P<loss>\S+) (?P<speed>\S+)", "unknown named group"),
])
def test_custom_pattern_mistakes_are_explained(pattern: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        compile_pattern(pattern)


def test_parser_makes_rank_steps_with_per_step_times() -> None:
    parser = ProgressParser()
    assert parser.feed(0, "iter 0: loss 4.0", now=100.0) is not None
    step = parser.feed(0, "iter 10: loss 3.0", now=102.0)
    assert step is not None
    assert (step.rank, step.step, step.loss, step.time) == (0, 10, 3.0, 102.0)
    assert step.step_time == pytest.approx(0.2)  # 2 s over 10 steps
    assert parser.feed(0, "iter 10: loss 3.0", now=103.0) is None  # the same step again
    assert parser.feed(0, "hello", now=103.0) is None
    assert parser.sources == {0: "nanogpt"}


def test_trainer_dicts_count_logged_steps_per_rank() -> None:
    parser = ProgressParser()
    line = "{'loss': 2.0, 'learning_rate': 1e-05, 'epoch': 0.1}"
    steps = [parser.feed(rank, line, now=float(i)) for i, rank in enumerate([0, 0, 1, 0])]
    assert [(s.rank, s.step) for s in steps if s is not None] == [(0, 1), (0, 2), (1, 1), (0, 3)]
    parser.reset()
    again = parser.feed(0, line, now=9.0)
    assert again is not None and again.step == 1 and again.step_time is None
