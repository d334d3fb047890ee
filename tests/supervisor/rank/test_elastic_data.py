"""The data cursor in samples (``supervisor/rank/elastic_data.py``): one stream of the dataset
that every world size splits, and ``Run.batches`` placing it where a checkpoint left it. The
same runs for real across a node eviction in ``tests/e2e/test_multinode.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from babysit import ElasticSampler
from babysit.supervisor.contract.directive import Directive, LrRamp, Resume, SkipRange
from babysit.supervisor.rank.api import Run


def ranks(world: int, n: int = 100, batch: int = 4, **kw: object) -> list[ElasticSampler]:
    return [ElasticSampler(n, batch, rank=r, world_size=world, **kw)  # type: ignore[arg-type]
            for r in range(world)]


def draw(samplers: list[ElasticSampler], cursor: int, batches: int) -> list[int]:
    """Every rank's indices of ``batches`` global batches from global batch ``cursor``."""
    out: list[int] = []
    its = []
    for s in samplers:
        s.seek(cursor)
        its.append(iter(s))
    for _ in range(batches):
        for it in its:
            out += next(it)
    return out


def test_a_resize_goes_on_at_the_next_sample_none_skipped_none_repeated() -> None:
    """3 ranks of 4 take global batches 0-6 (84 samples); the checkpoint at cursor 7 records
    84; 2 ranks of 4 resume there and take 10 more; then 4 ranks from that run's cursor 17:
    the indices are the stream's first 84 + 80 + 160 positions, each once, across epochs."""
    stream = ElasticSampler(100, 1, rank=0, world_size=1, seed=3)
    it = iter(stream)  # an endless stream: taken by hand
    order = [next(it)[0] for _ in range(324)]
    three = ranks(3, seed=3)
    seen = draw(three, 0, 7)
    saved = three[0].samples_at(7)
    assert saved == 84
    two = ranks(2, seed=3)
    for s in two:
        s.anchor(7, saved)
    seen += draw(two, 7, 10)
    four = ranks(4, seed=3)
    for s in four:
        s.anchor(17, two[0].samples_at(17))
    seen += draw(four, 17, 10)
    assert seen == order  # in stream order, batch by batch: nothing skipped, nothing twice
    assert sorted(order[:100]) == list(range(100))  # one epoch is a permutation
    assert order[:100] != order[100:200]  # and the next epoch another


def test_a_global_batch_is_the_ranks_slices_in_rank_order() -> None:
    a, b = ranks(2, n=10, batch=3, shuffle=False)
    assert (next(iter(a)), next(iter(b))) == ([0, 1, 2], [3, 4, 5])
    a.seek(1)  # global batch 1: positions 6-11, across the epoch's end
    assert next(iter(a)) == [6, 7, 8]
    b.seek(1)
    assert next(iter(b)) == [9, 0, 1]


def test_epochs_end_the_stream_and_drop_a_partial_global_batch() -> None:
    [only] = ranks(1, n=10, batch=4, shuffle=False, epochs=2)
    assert len(only) == 5 and len(list(only)) == 5  # 20 samples: 5 batches of 4
    a, _ = ranks(2, n=10, batch=4, shuffle=False, epochs=1)
    assert len(list(a)) == 1  # 8 of 10 samples: the second global batch would be partial
    with pytest.raises(TypeError, match="endless"):
        len(ranks(1)[0])


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="batch_size >= 1"):
        ElasticSampler(10, 0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
        ElasticSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="epochs"):
        ElasticSampler(10, 2, epochs=0, rank=0, world_size=1)


def run_for(directive: Directive) -> Run:
    return Run(rank=0, world_size=1, directive=directive, sock=None, token=b"")


def test_run_batches_resumes_a_data_loader_at_the_checkpoints_sample() -> None:
    """A checkpoint at cursor 5 recorded 37 samples consumed (another world size saved it):
    the DataLoader's first batch is stream positions 37-40, then skips move it in global
    batches of this world size, and each save asks the samples at its cursor."""
    data = TensorDataset(torch.arange(50))
    sampler = ElasticSampler(50, 4, shuffle=False, rank=0, world_size=1)
    loader = DataLoader(data, batch_sampler=sampler)
    run = run_for(Directive(resume=Resume(path="ckpt", step=5, cursor=5, samples=37),
                            skip=(SkipRange(6, 8),)))
    got = []
    for (x,) in run.batches(loader):
        got.append(x.tolist())
        if len(got) == 3:
            break
    # cursor 5 -> 37..40; cursor 6-7 skipped (positions 41-48); cursor 8 -> 49, 0, 1, 2
    assert got[:2] == [[37, 38, 39, 40], [49, 0, 1, 2]]
    assert run._checkpointer.samples_at is not None
    assert run._checkpointer.samples_at(10) == 37 + 5 * 4


def test_run_batches_without_a_record_counts_global_batches_of_this_size(tmp_path: Path) -> None:
    """A checkpoint saved before the script used the sampler: as many global batches of this
    world size as the cursor counts (exact when the world size did not change)."""
    sampler = ElasticSampler(100, 4, shuffle=False, rank=0, world_size=1)
    run = run_for(Directive(resume=Resume(path=str(tmp_path), step=3, cursor=3)))
    assert next(iter(run.batches(sampler))) == [12, 13, 14, 15]


def test_a_second_loop_over_the_same_sampler_goes_on_where_the_first_stopped() -> None:
    sampler = ElasticSampler(100, 4, shuffle=False, rank=0, world_size=1)
    run = run_for(Directive())
    first = run.batches(sampler)
    assert [next(first), next(first)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next(iter(run.batches(sampler))) == [8, 9, 10, 11]
    assert run._checkpointer.samples_at is not None and run._checkpointer.samples_at(3) == 12


def test_built_before_the_process_group_it_takes_its_place_from_torchrun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = ElasticSampler(30, 2, shuffle=False)
    assert (sampler.rank, sampler.world_size, next(iter(sampler))) == (2, 3, [4, 5])


def test_a_loop_over_another_loader_first_still_places_the_sampler_by_the_record() -> None:
    """Resumed at cursor 5 with 37 samples recorded; 2 global batches drawn from another
    loader first (cursor 7): the sampler starts at 37 + 2 x 4. A later loop over a loader
    without the sampler records no samples with its checkpoints."""
    run = run_for(Directive(resume=Resume(path="ckpt", step=5, cursor=5, samples=37)))
    plain = run.batches([["a"], ["b"], ["c"], ["d"], ["e"], ["f"], ["g"], ["h"]])
    assert [next(plain), next(plain)] == [["f"], ["g"]]
    sampler = ElasticSampler(100, 4, shuffle=False, rank=0, world_size=1)
    assert next(iter(run.batches(sampler))) == [45, 46, 47, 48]
    next(iter(run.batches([[0]] * 20)))
    assert run._checkpointer.samples_at is None


def test_a_checkpoint_the_script_saves_itself_records_the_samples_too(tmp_path: Path) -> None:
    from babysit.checkpoints import read_manifest, step_dir

    run = run_for(Directive(checkpoint_dir=str(tmp_path / "ckpt")))
    draws = run.batches(ElasticSampler(100, 4, shuffle=False, rank=0, world_size=1))
    for _ in range(3):
        next(draws)
    run.step_count = 3
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"the script's own state")
    run.checkpoint_saved(mine)
    assert read_manifest(step_dir(tmp_path / "ckpt", 3)).samples == 12


def test_a_skip_met_on_four_ranks_skips_the_same_samples_on_two(tmp_path: Path) -> None:
    """The attempt that meets a spike draws on 4 ranks of 2 (8 samples a global batch) and
    says where its stream is; the rollback's skip of its batches 89-169 is given to the next
    attempt in samples; that attempt, on 2 ranks of 5 (10 a global batch), trains none of
    those samples, and of the good ones around them loses fewer than one of its own batches."""
    import socket

    from babysit.policies.loader import load_policy
    from babysit.policies.rerun import Seen
    from babysit.supervisor.contract import protocol
    from babysit.supervisor.run.watch import Watch
    from tests.supervisor.run.test_rollback import DATA_FIRST, remedy

    TOKEN = b"t" * protocol.TOKEN_BYTES
    met = Resume(path=str(tmp_path), step=60, cursor=60, samples=480)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs:
        four = Run(rank=0, world_size=4, directive=Directive(resume=met), sock=ours, token=TOKEN)
        loader = DataLoader(TensorDataset(torch.arange(4000)),
                            batch_sampler=ElasticSampler(4000, 2, shuffle=False, rank=0,
                                                         world_size=4))
        (x,) = next(iter(four.batches(loader)))
        assert x.tolist() == [480, 481]  # global batch 60 of 8: rank 0's slice
        event = protocol.decode(TOKEN, theirs.recv(65536))
    assert isinstance(event, protocol.WorkerEvent) and event.type == "stream"
    assert event.data == {"cursor": 60, "samples": 480, "global_batch": 8}

    watch = Watch(load_policy("default", DATA_FIRST))
    watch.new_attempt(0.0, Directive(attempt=1, resume=met))
    watch.observe_stream(event.data)
    for s in range(61, 130):
        watch.trace.add(s, Seen(s, None, None))  # one global batch a step
    # Spike onset at step 100, found at 120: batches 89-169 skipped (10 before, 50 after).
    resume = Resume(path=str(tmp_path), step=80, cursor=80, samples=640)
    directive, _ = watch.launch(2, remedy(), resume)
    (skip,) = directive.skip
    assert skip == SkipRange(89, 170, (480 + 29 * 8, 480 + 110 * 8))  # samples 712-1359
    # The LR: x0.5 from the skip on, back to x1 over 50 batches past it, in samples too.
    assert directive.lr_ramp == LrRamp(89, 170, 220, 1.0, (712, 1360, 1760))
    directive = Directive.from_json(json.loads(json.dumps(directive.to_json())))  # as read
    # ...and carried through a takeover.
    heir = Watch(load_policy("default", DATA_FIRST))
    heir.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert heir.skips == [skip]

    trained: list[int] = []
    for rank in (0, 1):
        run = Run(rank=rank, world_size=2, directive=directive, sock=None, token=b"")
        loader = DataLoader(TensorDataset(torch.arange(4000)),
                            batch_sampler=ElasticSampler(4000, 5, shuffle=False, rank=rank,
                                                         world_size=2))
        scales = {}
        for (x,) in run.batches(loader):
            trained += x.tolist()
            scales[run.cursor] = run.lr_scale
            if run.cursor == 170:  # 90 of this attempt's batches
                break
    bad = set(range(712, 1360))
    assert not bad & set(trained)
    # Its batches 87-151 hold samples 710-1359: two good ones go with the bad (710, 711).
    assert sorted(trained) == [*range(640, 710), *range(1360, 1360 + (170 - 152) * 10)]
    # ...and its LR is full up to the skip (its batch 87, where sample 712 is), cut past it
    # (batch 152, sample 1360) and back to x1 by its batch 192, sample 1760, where the attempt
    # that planned it would have had it.
    assert run.directive.lr_ramp == LrRamp(87, 152, 192, 1.0, (712, 1360, 1760))
    assert (scales[87], scales[153], scales[170]) == (1.0, 0.5 + 0.5 * 1 / 40,
                                                      0.5 + 0.5 * 18 / 40)


def test_skips_in_samples_that_meet_in_this_sizes_batches_are_one_jump() -> None:
    """Two skips met 16 samples apart at 8 a global batch, resumed at 16 a batch: batches 5
    and 6 of the new size; both skipped, none of samples 80-87 or 96-103 trained."""
    directive = Directive(skip=(SkipRange(10, 11, (80, 88)), SkipRange(12, 13, (96, 104))))
    run = run_for(directive)
    sampler = ElasticSampler(200, 16, shuffle=False, rank=0, world_size=1)
    got: list[int] = []
    for batch in run.batches(sampler):
        got += batch
        if run.cursor == 8:
            break
    assert got == [*range(0, 80), *range(112, 128)]


def test_a_watch_counts_batches_before_the_last_resume_at_the_size_that_drew_them(
        tmp_path: Path) -> None:
    """8 samples a batch up to the checkpoint at batch 100 (sample 800), 4 after it: batch 95
    held samples 760-767, not 780."""
    from babysit.policies.loader import load_policy
    from babysit.supervisor.run.watch import Watch

    watch = Watch(load_policy("default"))
    watch.observe_stream({"cursor": 0, "samples": 0, "global_batch": 8})
    watch.observe_stream({"cursor": 130, "samples": 1040, "global_batch": 8})  # a later line
    resume = Resume(path=str(tmp_path), step=100, cursor=100, samples=800)
    watch.new_attempt(0.0, Directive(attempt=2, resume=resume))  # drops the line past 100
    watch.observe_stream({"cursor": 100, "samples": 800, "global_batch": 4})
    assert watch.in_samples(SkipRange(95, 110)) == SkipRange(95, 110, (760, 840))
