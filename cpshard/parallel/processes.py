"""Local CPU ranks sharing one gloo group: ``launch`` for one job, ``LocalRanks`` for many.

Workers are fresh (spawned) processes; each call runs the same function on every rank and
returns the results in rank order. A failure is raised in the caller naming the rank that failed
first with its own cause: its exception and traceback, its exit code or the signal that killed it,
never a peer's broken connection. Once a rank has failed, the others get until they stop working
(idle, as when they wait for the failed rank in a collective) to report; then the group is ended.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch.multiprocessing as mp

_POLL_SECONDS = 0.05
#: once a rank has failed, how long another may sit idle (no CPU used) before the group is ended
_IDLE_SECONDS = 1.0
#: ... and how long one still busy gets to report
_GRACE_SECONDS = 20.0
#: how often a rank looks for its launcher
_PARENT_POLL_SECONDS = 1.0
#: what a rank raises when a peer is gone: a consequence, never the cause
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote worker crash", re.IGNORECASE)


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed: what it raised (``kind``, ``message``, ``traceback``), or, when it ended
    without reporting, its ``exitcode`` (negative: the signal that killed it) and any fault dump."""

    rank: int
    kind: str
    message: str
    traceback: str
    exitcode: int | None = None
    #: when it failed (``time.time()``; for a rank found dead, when it was found)
    at: float = 0.0

    @property
    def cause(self) -> str:
        if self.exitcode is None:
            return f"raised {self.kind}: {self.message}"
        return self.message

    @property
    def peer_gone(self) -> bool:
        """A collective that broke because another rank went away (the other rank is the cause)."""
        return self.exitcode is None and bool(_PEER_GONE.search(self.message))


def _died(rank: int, exitcode: int, fault_dump: str) -> RankFailure:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else "?"
        how = f"was killed by signal {name} ({-exitcode})"
    else:
        how = f"exited with code {exitcode}"
    return RankFailure(rank, "exit", f"{how} before finishing", fault_dump, exitcode, time.time())


def _blame_order(failures: dict[int, RankFailure]) -> list[int]:
    """Ranks by blame: causes before peers' broken connections, then the first to fail."""
    return sorted(failures, key=lambda rank: (failures[rank].peer_gone, failures[rank].at, rank))


class RankError(RuntimeError):
    """One or more ranks failed; ``failures`` holds each one (by rank), ``rank`` the one to blame."""

    def __init__(self, failures: dict[int, RankFailure], note: str = ""):
        self.failures = failures
        order = _blame_order(failures)
        first = failures[order[0]]
        self.rank = first.rank
        others = sorted(order[1:])
        also = f" (ranks {others} failed too)" if others else ""
        super().__init__(f"rank {first.rank} {first.cause}{also}{note}\n{first.traceback}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(value) -> bytes:
    """Pickle now, as a queue would later in its feeder thread, where an error would be lost.

    Plain pickle, tensors by value: torch's shared-memory passing of tensors between these
    processes was seen to stall the result queue."""
    return pickle.dumps(value)


def _check_importable(fn) -> None:
    """Spawned ranks find ``fn`` by importing its module: ``__main__`` of ``python -c``, a notebook or
    the REPL has no file they can import, and would fail there with a bare AttributeError."""
    module = getattr(fn, "__module__", None)
    if module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise TypeError(
            f"cannot send {getattr(fn, '__qualname__', fn)!r} to the ranks: it is defined in an interactive "
            "__main__ (python -c, a notebook or the REPL) that fresh processes cannot import; "
            "define it in a .py file and import it, or run a script (python script.py)"
        )


def _unpickling_failure(rank: int, error: BaseException) -> RankFailure:
    return RankFailure(
        rank,
        type(error).__name__,
        f"this rank could not load the function or arguments sent to it ({error}); fn must be a "
        "module-level function of an importable file and its arguments picklable",
        traceback.format_exc(),
        at=time.time(),
    )


def _exit_with(launcher: int, store_dir: str) -> None:
    """End this process once its launcher is gone: killed, or stopped by a signal that skips its exit
    handlers (``timeout``'s SIGTERM), it cannot close its ranks, which would compute, or wait for a task,
    for ever (orphans of several GB each were seen outliving a killed run), nor remove the group's folder."""

    def watch():
        while os.getppid() == launcher:
            time.sleep(_PARENT_POLL_SECONDS)
        shutil.rmtree(store_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="cpshard-launcher-watch", daemon=True).start()


def _worker(
    rank: int, nprocs: int, store_dir: str, port: int, timeout: float, tasks, results, launcher: int
) -> None:
    _exit_with(launcher, store_dir)
    # a terminal's ^C reaches the whole process group: the launcher ends its ranks, which print nothing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    # a crash (segfault, abort) leaves its Python traceback for the caller to read
    fault_file = open(_fault_path(store_dir, rank), "w")  # noqa: SIM115 - open while the process lives
    faulthandler.enable(fault_file)
    # the launcher's variables, for code that reads them; the group itself meets in a file, so
    # that groups started side by side (tests, benchmarks) can never race for a port
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(store_dir, 'store')}",
        rank=rank,
        world_size=nprocs,
        timeout=timedelta(seconds=timeout),
    )
    while (task := tasks.get()) is not None:
        try:
            fn, args, kwargs = pickle.loads(task)
        except BaseException as error:  # noqa: BLE001 - told to the caller
            results.put((rank, False, _dumps(_unpickling_failure(rank, error))))
            continue
        try:
            results.put((rank, True, _dumps(fn(*args, **kwargs))))
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
            failure = RankFailure(
                rank, type(error).__name__, str(error), traceback.format_exc(), at=time.time()
            )
            results.put((rank, False, _dumps(failure)))
    dist.destroy_process_group()


def _fault_path(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"rank{rank}.faults")


def _cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of ``pid`` in clock ticks (Linux /proc); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


class _Watch:
    """When each pending rank last used CPU: a rank idle since a peer failed is waiting for nothing."""

    def __init__(self):
        self._ticks: dict[int, int | None] = {}
        self._busy_at: dict[int, float] = {}

    def idle(self, pids: dict[int, int], now: float) -> bool:
        for rank, pid in pids.items():
            ticks = _cpu_ticks(pid)
            if ticks is None or ticks != self._ticks.get(rank):
                self._ticks[rank], self._busy_at[rank] = ticks, now
        return all(
            self._ticks[rank] is not None and now - self._busy_at[rank] >= _IDLE_SECONDS for rank in pids
        )


class LocalRanks:
    """``nprocs`` local CPU processes in one gloo group, reused across calls; a context manager."""

    def __init__(self, nprocs: int, timeout: float = 600.0):
        if nprocs < 1:
            raise ValueError(f"nprocs={nprocs} must be at least 1")
        self.nprocs, self.timeout = nprocs, timeout
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(nprocs)]
        self._store_dir = tempfile.mkdtemp(prefix="cpshard-ranks-")
        port = _free_port()
        self._processes = [
            context.Process(
                target=_worker,
                args=(
                    rank,
                    nprocs,
                    self._store_dir,
                    port,
                    timeout,
                    self._tasks[rank],
                    self._results,
                    os.getpid(),
                ),
                daemon=True,
            )
            for rank in range(nprocs)
        ]
        for process in self._processes:
            process.start()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)  # the caller stopped (an error, ^C): the ranks may be busy

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def run(self, fn, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the return values in rank order."""
        if not self.alive:
            raise RuntimeError(
                "these local ranks are closed (a rank failed or close() was called); start new ones"
            )
        _check_importable(fn)
        try:
            payload = _dumps((fn, args, kwargs))
        except Exception as error:
            raise TypeError(
                f"cannot send {fn!r} and its arguments to the ranks ({error}); "
                "fn must be a module-level function and its arguments picklable"
            ) from error
        for tasks in self._tasks:
            tasks.put(payload)
        return self._collect()

    def _collect(self) -> list:
        """Every rank's report; on a failure, the group is ended as soon as no rank is left working."""
        values: dict[int, bytes] = {}
        failures: dict[int, RankFailure] = {}
        seen: list[int] = []  # the ranks that reported or were found dead
        deadline = time.monotonic() + self.timeout
        watch = _Watch()
        while len(seen) < self.nprocs:
            try:
                rank, ok, value = self._results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                pass
            else:
                seen.append(rank)
                if ok:
                    values[rank] = value  # unpickled once every rank has reported: none is left in the queue
                else:
                    failures[rank] = pickle.loads(value)
                    deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
                continue
            for rank, process in enumerate(self._processes):
                if rank not in seen and process.exitcode is not None:
                    seen.append(rank)
                    failures[rank] = _died(rank, process.exitcode, self._fault_dump(rank))
            pending = [rank for rank in range(self.nprocs) if rank not in seen]
            dead = any(failure.exitcode is not None for failure in failures.values())
            now = time.monotonic()
            stuck = bool(failures) and watch.idle({r: self._processes[r].pid for r in pending}, now)
            if dead or (pending and (stuck or now > deadline)):  # a group that lost a rank is no group
                self.close(force=True)
                if not failures:
                    raise TimeoutError(
                        f"ranks {pending} did not finish within {self.timeout:g} s; the group was ended"
                    )
                unfinished = f"; ranks {pending} did not finish" if pending else ""
                raise RankError(failures, note=f"{unfinished}; the group was ended")
        if failures:
            raise RankError(failures)
        return [pickle.loads(values[rank]) for rank in range(self.nprocs)]

    def _fault_dump(self, rank: int) -> str:
        try:
            with open(_fault_path(self._store_dir, rank)) as dump:
                return dump.read()
        except OSError:
            return ""

    def close(self, force: bool = False) -> None:
        """Stop every worker (politely unless ``force``); safe to call twice."""
        if not force:
            for tasks, process in zip(self._tasks, self._processes):
                if process.is_alive():
                    tasks.put(None)
            for process in self._processes:
                process.join(timeout=10)
        for process in self._processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        self._processes = []
        shutil.rmtree(self._store_dir, ignore_errors=True)


def launch(fn, *args, nprocs: int, timeout: float = 600.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` fresh local CPU ranks; their results in rank order.

    ``timeout`` (seconds) bounds the whole run and is not passed to ``fn``.
    """
    _check_importable(fn)  # before any rank starts
    with LocalRanks(nprocs, timeout=timeout) as ranks:
        return ranks.run(fn, *args, **kwargs)
