"""This process's resident memory: the peak (resettable on Linux) and the current size."""

from __future__ import annotations

import resource


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
