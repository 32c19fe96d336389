"""How much memory this machine has, and has free: /proc/meminfo, bounded by the process's cgroup where it has a limit.

    total_memory()       # bytes the app may ever hold: MemTotal, or the container's limit where that is lower
    available_memory()   # bytes it could take now: MemAvailable, or what the container's limit leaves
    grown(floor, beside) # a budget: `floor`, or the memory less `beside` where that is more

Why the cgroup: a Hugging Face CPU Space is a 16 GB container on a larger host, and /proc/meminfo there shows the
host. A memory plan sized from the host's numbers would take memory the container does not have. cgroup v2 is read
first (memory.max, memory.current), then v1 (memory.limit_in_bytes, memory.usage_in_bytes); a limit above MemTotal,
or "max", means none. What the cgroup uses counts its inactive file pages as free: the kernel reclaims them first.
"""
from __future__ import annotations

from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
# (limit, usage, the stat file's inactive file pages) per cgroup version, newest first
_LAYOUTS = (("memory.max", "memory.current", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"))


def total_memory(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """The machine's or the container's memory in bytes, whichever is less; None where neither can be read."""
    host = _meminfo("MemTotal:", meminfo)
    limit = _cgroup(cgroup, host)
    if limit is None:
        return host
    return limit[0] if host is None else min(host, limit[0])


def available_memory(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """Bytes the kernel could hand this process now, whichever of the machine and the container is shorter; None
    where neither can be read."""
    host, limit = _meminfo("MemAvailable:", meminfo), _cgroup(cgroup, _meminfo("MemTotal:", meminfo))
    if limit is None:
        return host
    room = max(limit[0] - limit[1], 0)
    return room if host is None else min(host, room)


def grown(floor: int, beside: int, total: int | None = None) -> int:
    """`floor` bytes, or the machine's memory (`total`, default this one's) less `beside` where that is more: a budget
    sized for a 16 GiB machine that grows on a larger one (the weights plan's and the app's, which must grow alike)."""
    total = total_memory() if total is None else total
    return floor if total is None else max(floor, total - beside)


def _cgroup(root: Path, host: int | None) -> tuple[int, int] | None:
    """(limit, bytes in use less inactive file pages) of the cgroup mounted at `root`, or None where it sets no
    limit below the machine's memory `host` or cannot be read."""
    for limit_name, usage_name, inactive_key in _LAYOUTS:
        limit_file = root / limit_name
        try:
            text = limit_file.read_text().strip()
            if text == "max":
                return None
            limit, usage = int(text), int((root / usage_name).read_text())
        except (OSError, ValueError):
            continue
        if host is not None and limit >= host:
            return None
        return limit, max(usage - _inactive_file(limit_file.parent / "memory.stat", inactive_key), 0)
    return None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _meminfo(field: str, meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
