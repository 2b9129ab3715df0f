"""The comms log: what a recording holds, its sums per op, name and phase, and nesting."""

import pytest
import torch

from cpshard.comm.record import CommEvent, active_log, active_recorder, record, recording, serving

#: (op, name, phase, tensor, group size), as the collectives report them
LAUNCHES = [
    ("all_to_all", "layers.0.self_attn q", "forward", torch.zeros(2, 8, 4), 2),
    ("all_to_all", "layers.0.self_attn q", "backward", torch.zeros(2, 8, 4), 2),
    ("all_reduce", "loss", "forward", torch.zeros((), dtype=torch.float64), 4),
    ("all_reduce", "gradients", "backward", torch.zeros(10, dtype=torch.bfloat16), 4),
    ("all_gather", "batch fingerprint", "forward", torch.zeros(3, dtype=torch.int64), 2),
]


def _launch(launches):
    for op, name, phase, tensor, size in launches:
        record(active_recorder(), op, name, phase, tensor, size)


def _total(launches):
    return sum(t.numel() * t.element_size() for *_, t, _ in launches)


def _expected_sums(launches, field: int):
    totals, counts = {}, {}
    for launch in launches:
        key, nbytes = launch[field], launch[3].numel() * launch[3].element_size()
        totals[key] = totals.get(key, 0) + nbytes
        counts[key] = counts.get(key, 0) + 1
    return totals, counts


def test_nothing_is_recorded_without_a_recording():
    assert active_log() is None
    _launch(LAUNCHES)  # no error, nowhere to go
    record(None, "all_reduce", "x", "forward", torch.zeros(3), 2)
    assert active_log() is None


def test_events_in_launch_order():
    with recording() as log:
        assert active_log() is log
        _launch(LAUNCHES)
    assert active_log() is None
    expected = [
        CommEvent(op, name, phase, t.numel() * t.element_size(), size)
        for op, name, phase, t, size in LAUNCHES
    ]
    assert log.events == expected
    assert [e.nbytes for e in log.events] == [256, 256, 8, 20, 24]


@pytest.mark.parametrize("field, key", [(0, "op"), (1, "name"), (2, "phase")])
def test_sums_by_field(field, key):
    with recording() as log:
        _launch(LAUNCHES)
    totals, counts = _expected_sums(LAUNCHES, field)
    assert log.bytes_by(key) == totals
    assert log.count_by(key) == counts
    assert log.total_bytes == sum(totals.values()) == _total(LAUNCHES)


def test_empty_recording():
    with recording() as log:
        pass
    assert (
        log.events == [] and log.total_bytes == 0 and log.bytes_by("op") == {} and log.count_by("phase") == {}
    )


def test_nested_recordings_each_see_what_ran_inside_them():
    outer_only, inner_only = LAUNCHES[:2], LAUNCHES[2:]
    with recording() as outer:
        _launch(outer_only)
        with recording() as inner:
            assert active_log() is inner
            _launch(inner_only)
        assert active_log() is outer
    assert inner.total_bytes == _total(inner_only) and len(inner.events) == len(inner_only)
    assert outer.total_bytes == _total(LAUNCHES) and len(outer.events) == len(LAUNCHES)


def test_recording_ends_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with recording():
            raise RuntimeError("boom")
    assert active_log() is None


def test_each_collective_serves_the_parallelism_of_the_block_it_is_launched_in():
    launched = {"cp": None, "fsdp": "fsdp", "replicas": "replicas", "tp": "tp", "ep": "ep", "other": "other"}
    with recording() as log:
        for index, parallelism in enumerate(launched.values()):
            if parallelism is None:
                record(active_recorder(), "all_to_all", "q", "forward", torch.zeros(index + 1), 2)
                continue
            with serving(parallelism):
                recorder = active_recorder()
            # a backward reports through the recorder its forward took, outside the block
            record(recorder, "all_reduce", parallelism, "backward", torch.zeros(index + 1), 2)
    assert [e.parallelism for e in log.events] == list(launched)
    assert log.bytes_by_parallelism() == {kind: 4 * (i + 1) for i, kind in enumerate(launched)}


def test_nested_serving_blocks_the_inner_one_counts():
    with recording() as log, serving("tp"):
        with serving("ep"):
            record(active_recorder(), "all_to_all", "dispatch", "forward", torch.zeros(1), 2)
        record(active_recorder(), "all_reduce", "tp sum", "forward", torch.zeros(1), 2)
    assert [e.parallelism for e in log.events] == ["ep", "tp"]


def test_serving_an_unknown_parallelism_is_an_error():
    with pytest.raises(ValueError, match="serving\\('dp'\\): a parallelism is one of"):
        with serving("dp"):
            pass
