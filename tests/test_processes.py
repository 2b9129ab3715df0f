"""Local ranks: results in rank order, and every way a rank can fail: it raises, it exits, it stalls.

The shared ``ranks2`` group takes the failures it survives; a rank that exits or stalls ends its group,
so those two get groups of their own.
"""

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cpshard import LocalRanks, RankError, launch
from cpshard.parallel import processes


def _identify(tag, scale=None):
    rank = dist.get_rank()
    return rank, os.getpid(), tag, None if scale is None else scale * rank


def _raise_on(*ranks):
    if dist.get_rank() in ranks:
        raise ValueError(f"bad value on rank {dist.get_rank()}")
    return "fine"


def _sum_of_ranks():
    total = torch.tensor(dist.get_rank() + 1)
    dist.all_reduce(total)
    return total.item()


def _unpicklable():
    return lambda: None


def _loads_on_ranks_only():
    if not dist.is_initialized():
        raise RuntimeError("this result only loads on a rank")
    return "loaded"


class _RankOnlyResult:
    def __reduce__(self):
        return _loads_on_ranks_only, ()


def _rank_0_returns_what_the_caller_cannot_load():
    if dist.get_rank() == 0:
        return _RankOnlyResult()
    time.sleep(0.5)  # reports after rank 0
    return "fine"


def _stall_on(rank, seconds):
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return os.getpid()


def _exit_on_rank_1(folder):
    rank = dist.get_rank()
    Path(folder, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        while not Path(folder, "0.pid").exists():  # both ranks are running
            time.sleep(0.01)
        os._exit(3)
    time.sleep(120)  # rank 0 would wait far past the test: the group must end it


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _write_pid_then(folder, action):
    """Every rank records its pid; then rank 1 raises while rank 0 waits for it in a collective
    ("raise"), or rank 1 stalls while rank 0 finishes ("stall")."""
    rank = dist.get_rank()
    Path(folder, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1 and action == "raise":
        raise ValueError("rank 1 gives up")
    if rank == 1 and action == "stall":
        time.sleep(600)
    if action == "raise":
        dist.barrier()  # rank 1 never comes: only ending the group ends rank 0
    return "done"


def _left_behind(folder) -> list[int]:
    """The pids the ranks wrote that still run, or are still children of this process."""
    pids = [int(path.read_text()) for path in sorted(Path(folder).glob("*.pid"))]
    assert len(pids) == 2, "both ranks started"
    children = {child.pid for child in multiprocessing.active_children()}
    return [pid for pid in pids if not _gone(pid) or pid in children]


def test_results_in_rank_order(ranks2):
    results = ranks2.run(_identify, "tag", scale=torch.tensor([1.0, 2.0]))
    assert [r[0] for r in results] == [0, 1]
    assert len({r[1] for r in results} | {os.getpid()}) == 3  # two processes of their own
    assert [r[2] for r in results] == ["tag", "tag"]
    torch.testing.assert_close(results[1][3], torch.tensor([1.0, 2.0]))


def test_a_raising_rank_is_named_with_its_traceback(ranks2):
    with pytest.raises(RankError) as info:
        ranks2.run(_raise_on, 1)
    assert set(info.value.failures) == {1}
    failure = info.value.failures[1]
    assert (failure.rank, failure.kind, failure.message) == (1, "ValueError", "bad value on rank 1")
    assert "_raise_on" in failure.traceback and 'raise ValueError(f"bad value' in failure.traceback
    assert str(info.value).startswith("rank 1 raised ValueError: bad value on rank 1")
    assert failure.traceback in str(info.value)


def test_the_group_stays_usable_after_every_rank_raises(ranks2):
    with pytest.raises(RankError) as info:
        ranks2.run(_raise_on, 0, 1)
    assert sorted(info.value.failures) == [0, 1]
    assert all(f.kind == "ValueError" for f in info.value.failures.values())
    assert "(ranks [1] raised too)" in str(info.value)
    assert ranks2.alive
    assert ranks2.run(_sum_of_ranks) == [3, 3]


def test_what_cannot_be_sent_fails_at_once(ranks2):
    start = time.monotonic()
    with pytest.raises(TypeError, match="module-level function"):
        ranks2.run(lambda: 1)
    with pytest.raises(RankError, match="pickle"):
        ranks2.run(_unpicklable)
    assert time.monotonic() - start < 10
    assert ranks2.run(_sum_of_ranks) == [3, 3]


def test_a_result_that_fails_to_load_leaves_nothing_behind(ranks2):
    with pytest.raises(RuntimeError, match="only loads on a rank"):
        ranks2.run(_rank_0_returns_what_the_caller_cannot_load)
    assert [tag for _, _, tag, _ in ranks2.run(_identify, "next")] == ["next", "next"]


def test_at_least_one_rank():
    with pytest.raises(ValueError, match="nprocs=0"):
        LocalRanks(0)


def test_a_stalled_rank_times_out_and_the_group_ends():
    with LocalRanks(2, timeout=300) as ranks:
        pids = [
            pid for _, pid, *_ in ranks.run(_identify, "warm")
        ]  # started: the short timeout is for the call alone
        ranks.timeout = 2.0
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 2 s"):
            ranks.run(_stall_on, 1, 60)
        assert 2 <= time.monotonic() - start < 10
        assert not ranks.alive and all(_gone(pid) for pid in pids)
        with pytest.raises(RuntimeError, match="closed"):
            ranks.run(_identify, "again")


def test_an_exiting_rank_ends_the_launch(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3") as info:
        launch(_exit_on_rank_1, str(tmp_path), nprocs=2, timeout=300)
    assert not isinstance(info.value, RankError)
    exited = tmp_path / "1.pid"
    assert time.time() - exited.stat().st_mtime < 60  # noticed well before the 300 s timeout
    assert not _left_behind(tmp_path), "a rank was left running"


def test_a_raising_rank_ends_the_launch_while_the_others_wait_in_a_collective(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "_GRACE_SECONDS", 2.0)  # how long the others get to report
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_write_pid_then, str(tmp_path), "raise", nprocs=2, timeout=300)
    assert set(info.value.failures) == {1} and info.value.failures[1].message == "rank 1 gives up"
    assert str(info.value).startswith("rank 1 raised ValueError: rank 1 gives up")
    assert "ranks [0] did not finish, so the group was ended" in str(info.value)
    assert time.monotonic() - start < 120, "ended long before the 300 s timeout"
    assert not _left_behind(tmp_path), "a rank was left running"


def test_a_stalled_rank_ends_the_launch_at_its_timeout(tmp_path):
    timeout = 30.0  # room for the ranks to start on a loaded machine (about 8 s on an idle one)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 30 s; the group was ended"):
        launch(_write_pid_then, str(tmp_path), "stall", nprocs=2, timeout=timeout)
    assert timeout <= time.monotonic() - start < timeout + 20
    assert not _left_behind(tmp_path), "a rank was left running"
