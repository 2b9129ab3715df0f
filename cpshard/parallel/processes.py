"""Local CPU ranks sharing one gloo group: ``launch`` for one job, ``LocalRanks`` for many.

Workers are fresh (spawned) processes; each call runs the same function on every rank and
returns the results in rank order. An exception on any rank is raised in the caller with
that rank's traceback; a rank that dies or stalls past the timeout ends the whole group.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch.multiprocessing as mp

_POLL_SECONDS = 0.05
#: how long the other ranks get to report once one rank has raised
_GRACE_SECONDS = 20.0


@dataclass(frozen=True)
class RankFailure:
    """What one rank raised: the exception's type, message and formatted traceback."""

    rank: int
    kind: str
    message: str
    traceback: str


class RankError(RuntimeError):
    """One or more ranks raised; ``failures`` holds each one (by rank)."""

    def __init__(self, failures: dict[int, RankFailure], note: str = ""):
        self.failures = failures
        first = failures[min(failures)]
        others = sorted(set(failures) - {first.rank})
        also = f" (ranks {others} raised too)" if others else ""
        super().__init__(
            f"rank {first.rank} raised {first.kind}: {first.message}{also}{note}\n{first.traceback}"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(value) -> bytes:
    """Pickle now, as a queue would later in its feeder thread, where an error would be lost.

    Plain pickle, tensors by value: torch's shared-memory passing of tensors between these
    processes was seen to stall the result queue."""
    return pickle.dumps(value)


def _worker(rank: int, nprocs: int, store: str, port: int, timeout: float, tasks, results) -> None:
    import torch
    import torch.distributed as dist

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
        init_method=f"file://{store}",
        rank=rank,
        world_size=nprocs,
        timeout=timedelta(seconds=timeout),
    )
    while (task := tasks.get()) is not None:
        try:
            fn, args, kwargs = pickle.loads(task)
            results.put((rank, True, _dumps(fn(*args, **kwargs))))
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
            failure = RankFailure(rank, type(error).__name__, str(error), traceback.format_exc())
            results.put((rank, False, _dumps(failure)))
    dist.destroy_process_group()


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
        store, port = os.path.join(self._store_dir, "store"), _free_port()
        self._processes = [
            context.Process(
                target=_worker,
                args=(rank, nprocs, store, port, timeout, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(nprocs)
        ]
        for process in self._processes:
            process.start()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def run(self, fn, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the return values in rank order."""
        if not self.alive:
            raise RuntimeError(
                "these local ranks are closed (a rank failed or close() was called); start new ones"
            )
        try:
            payload = _dumps((fn, args, kwargs))
        except Exception as error:
            raise TypeError(
                f"cannot send {fn!r} and its arguments to the ranks ({error}); "
                "fn must be a module-level function and its arguments picklable"
            ) from error
        for tasks in self._tasks:
            tasks.put(payload)
        values: dict[int, object] = {}
        failures: dict[int, RankFailure] = {}
        deadline = time.monotonic() + self.timeout
        while len(values) + len(failures) < self.nprocs:
            if failures:
                deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
            try:
                rank, ok, value = self._results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                self._check_progress(deadline, set(values) | set(failures), failures)
                continue
            if ok:
                values[rank] = value  # unpickled once every rank has reported, so none is left in the queue
            else:
                failures[rank] = pickle.loads(value)
        if failures:
            raise RankError(failures)
        return [pickle.loads(values[rank]) for rank in range(self.nprocs)]

    def _check_progress(self, deadline: float, done: set, failures: dict) -> None:
        """End the group when a rank died or the deadline passed."""
        dead = {r: p.exitcode for r, p in enumerate(self._processes) if not p.is_alive() and r not in done}
        late = time.monotonic() > deadline
        if not dead and not late:
            return
        pending = sorted(set(range(self.nprocs)) - done)
        self.close(force=True)
        if failures:
            raise RankError(failures, note=f"; ranks {pending} did not finish, so the group was ended")
        if dead:
            rank, code = min(dead.items())
            raise RuntimeError(f"rank {rank} exited with code {code} before finishing; the group was ended")
        raise TimeoutError(f"ranks {pending} did not finish within {self.timeout:g} s; the group was ended")

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
    with LocalRanks(nprocs, timeout=timeout) as ranks:
        return ranks.run(fn, *args, **kwargs)
