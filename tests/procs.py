"""What /proc says of local processes, for the tests that start and end ranks (Linux)."""

from pathlib import Path


def _stat(pid: int | str) -> list[str]:
    """The fields of a process's stat after its name (state, parent, ...); empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def children_of(pid: int) -> set[int]:
    """Every process whose parent is ``pid``."""
    return {
        int(path.name)
        for path in Path("/proc").iterdir()
        if path.name.isdigit() and (fields := _stat(path.name)) and int(fields[1]) == pid
    }


def running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited orphan may stay a zombie where nothing reaps it)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"
