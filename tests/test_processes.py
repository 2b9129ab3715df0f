"""Local ranks: results in rank order, and every way a rank can fail: it raises, it exits, it stalls.

The shared ``ranks2`` group takes the failures it survives; a rank that exits or stalls ends its group,
so those two get groups of their own.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from procs import children_of, running

from cpshard import LocalRanks, RankError, launch

pytestmark = pytest.mark.ranks  # every test here starts processes


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


def _loads_in_the_caller_only():
    if dist.is_initialized():
        raise RuntimeError("this argument only loads in the caller")
    return "loaded"


class _CallerOnlyArgument:
    def __reduce__(self):
        return _loads_in_the_caller_only, ()


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


def _fail_mid_step(folder, how):
    """Both ranks step through all-reduces; at step 3 rank 1 fails ``how`` (and notes the time) while
    rank 0 goes on into the next collective, where only ending the group ends it."""
    rank = dist.get_rank()
    Path(folder, f"{rank}.pid").write_text(str(os.getpid()))
    total = torch.ones(4)
    for step in range(1000):
        if rank == 1 and step == 3:
            Path(folder, "failed_at").write_text(repr(time.time()))
            if how == "exit":
                os._exit(3)
            if how == "signal":
                os.kill(os.getpid(), signal.SIGSEGV)
            raise ValueError("rank 1 gives up")
        dist.all_reduce(total)
    return "done"


def _exit_after_rank_0_reports():
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 has reported by now
        os._exit(4)
    return os.getpid()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _write_pid_then_stall(folder):
    """Every rank records its pid; then rank 1 stalls while rank 0 finishes."""
    rank = dist.get_rank()
    Path(folder, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    return "done"


def _left_behind(folder) -> list[int]:
    """The pids the ranks wrote that still run, or are still children of this process."""
    pids = [int(path.read_text()) for path in sorted(Path(folder).glob("*.pid"))]
    assert len(pids) == 2, "both ranks started"
    children = {child.pid for child in multiprocessing.active_children()} | children_of(os.getpid())
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
    first, other = info.value.rank, 1 - info.value.rank  # the first to fail is blamed
    assert str(info.value).startswith(f"rank {first} raised ValueError: bad value on rank {first}")
    assert f"(ranks [{other}] failed too)" in str(info.value)
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


def test_what_the_ranks_cannot_load_is_said_on_every_rank(ranks2):
    with pytest.raises(RankError) as info:
        ranks2.run(_identify, _CallerOnlyArgument())
    assert sorted(info.value.failures) == [0, 1]
    assert "could not load the function or arguments sent to it (this argument only loads in the caller)" in (
        str(info.value)
    )
    assert "module-level function of an importable file" in str(info.value)
    assert ranks2.run(_sum_of_ranks) == [3, 3]


def test_a_function_of_python_c_is_refused_before_any_rank_starts():
    script = "import cpshard\ndef f():\n    return 1\ncpshard.launch(f, nprocs=2)"
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "TypeError: cannot send 'f' to the ranks: it is defined in an interactive __main__"
    )
    assert "define it in a .py file and import it" in last
    assert time.monotonic() - start < 60


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


CAUSES = {
    "exit": ("rank 1 exited with code 3 before finishing", ""),
    "signal": ("rank 1 was killed by signal SIGSEGV (11) before finishing", "in _fail_mid_step"),
    "raise": ("rank 1 raised ValueError: rank 1 gives up", 'raise ValueError("rank 1 gives up")'),
}


@pytest.mark.parametrize("how", CAUSES)
def test_a_rank_failing_mid_step_is_named_at_once_and_the_group_ends(tmp_path, how):
    """The failed rank is blamed with its own cause (rank 0's broken collective is only "failed too"),
    the caller hears within seconds of the failure, and no rank is left running."""
    cause, traceback_line = CAUSES[how]
    with pytest.raises(RankError) as info:
        launch(_fail_mid_step, str(tmp_path), how, nprocs=2, timeout=300)
    seconds = time.time() - float((tmp_path / "failed_at").read_text())
    print(f"{how}: the caller heard {seconds:.2f} s after the failure")
    assert info.value.rank == 1 and str(info.value).startswith(cause), str(info.value)
    assert traceback_line in info.value.failures[1].traceback
    assert "Connection" not in str(info.value).splitlines()[0]
    assert seconds < 10, "the target is 5 s; generous for a loaded machine"
    assert not _left_behind(tmp_path), "a rank was left running"


def test_a_rank_dying_after_the_others_reported_ends_the_group():
    with LocalRanks(2, timeout=300) as ranks:
        pids = [pid for _, pid, *_ in ranks.run(_identify, "warm")]
        with pytest.raises(
            RankError, match="rank 1 exited with code 4 before finishing; the group was ended"
        ):
            ranks.run(_exit_after_rank_0_reports)
        assert not ranks.alive and all(_gone(pid) for pid in pids)  # rank 0 too, before close()


def test_a_stalled_rank_ends_the_launch_at_its_timeout(tmp_path):
    timeout = 20.0  # room for the ranks to start on a loaded machine (about 8 s on an idle one)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 20 s; the group was ended"):
        launch(_write_pid_then_stall, str(tmp_path), nprocs=2, timeout=timeout)
    assert timeout <= time.monotonic() - start < timeout + 20
    assert not _left_behind(tmp_path), "a rank was left running"


_LAUNCHER = """
import os, sys, time
from pathlib import Path

import torch.distributed as dist

from cpshard import launch


def stall(folder):
    Path(folder, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    launch(stall, sys.argv[1], nprocs=2)
"""


@pytest.mark.parametrize("signal_", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_end_with_their_launcher(tmp_path, signal_):
    """A launcher killed without closing its ranks (SIGKILL; ``timeout``'s SIGTERM skips the exit handlers
    too) leaves no rank running: each ends within seconds of its launcher, busy or idle."""
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    temp = tmp_path / "temp"  # the launcher's temp dir, where its group's folder goes
    temp.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], env={**os.environ, "TMPDIR": str(temp)}
    )
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    assert len(pids) == 2, "both ranks started"
    launcher.send_signal(signal_)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if running(pid)]
    for pid in left:  # not to leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
    assert not list(temp.glob("cpshard-ranks-*")), "the group's folder is left"
