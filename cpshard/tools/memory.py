"""This process's memory: the resident size (its peak, resettable on Linux, and now) and the peak of the
tensors a block of code allocates."""

from __future__ import annotations

import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _status_bytes(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status in bytes (None where there is no /proc)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Restart the peak-RSS count (Linux), so a later peak covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """This process's peak resident memory in bytes."""
    return _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """This process's resident memory now, in bytes."""
    return _status_bytes("VmRSS") or peak_rss()


def _storage_key(tensor: torch.Tensor) -> int | None:
    """Where a tensor's storage starts (a parameter's too); None for a wrapper that holds none."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class LiveTensors(TorchDispatchMode):
    """The peak total size of the storages the ops inside the block allocate, while they live: the CPU's
    counterpart of ``torch.cuda.max_memory_allocated``, exact and deterministic where the resident size
    also counts what glibc's heap keeps of freed blocks. The biggest storages alive near the peak
    (within 1 MiB of it) are kept with the op that made each, to say what the peak is made of.

    A storage is followed by a finalizer on the storage itself, not on a tensor: autograd can keep an
    op's saved output alive after every Python tensor of it is gone. Outputs that share an input's
    storage (views, in-place ops) allocate nothing."""

    def __init__(self, top: int = 12):
        super().__init__()
        self.top, self.total, self.peak, self.at_peak = top, 0, 0, []
        self._live: dict[int, tuple[int, str]] = {}
        self._noted = 0

    def _release(self, key: int) -> None:
        self.total -= self._live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor or t.device.type != "cpu":  # a wrapper holds no storage
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._live or key in inputs or storage.nbytes() == 0:
                continue
            what = f"{func.overloadpacket.__name__} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            self._live[key] = (storage.nbytes(), what)
            self.total += storage.nbytes()
            weakref.finalize(storage, self._release, key)
        if self.total > self.peak:
            self.peak = self.total
            if self.peak > self._noted + (1 << 20):
                self._noted, self.at_peak = self.peak, sorted(self._live.values(), reverse=True)[: self.top]
        return out
