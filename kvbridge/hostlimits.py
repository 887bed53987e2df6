"""What this host lets this process use, read where the kernel says it: the CPUs of its cgroup's
quota (:func:`cpu_quota`) and the memory it may still fill (:func:`memory_available`)."""

from __future__ import annotations

import os
from typing import Iterator, Optional

__all__ = ["cpu_quota", "memory_available"]


def _cgroup_dirs(controller: str, proc_cgroup: str, root: str) -> Iterator[tuple[str, bool]]:
    """This process's cgroup directories for ``controller`` -- its own, then each ancestor --
    each with whether it is cgroup v2 (whose one hierarchy holds every controller)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        hier, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hier == "0" and ctrls == "":      # v2: at the root, or at unified/ beside v1's
            v2 = True
            base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified")
        elif controller in ctrls.split(","):
            base, v2 = os.path.join(root, ctrls), False
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            yield os.path.join(base, *parts[:depth]), v2


def _read(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as f:
        return f.read().strip()


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[float]:
    """The CPUs this process's cgroup may use, by its CPU quota: the least ``quota / period``
    of its cgroup and their ancestors (cgroup v2 ``cpu.max``; v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``); None where no quota is set or none can be read."""
    found: list[float] = []
    for d, v2 in _cgroup_dirs("cpu", proc_cgroup, root):
        try:
            if v2:
                q, per = (_read(d, "cpu.max").split() + ["", ""])[:2]
            else:
                q, per = _read(d, "cpu.cfs_quota_us"), _read(d, "cpu.cfs_period_us")
        except (OSError, ValueError):
            continue
        if q.isdigit() and per.isdigit() and int(q) > 0 and int(per) > 0:     # not "max" nor -1
            found.append(int(q) / int(per))
    return min(found) if found else None


def memory_available(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes this process may still fill before the kernel reclaims by killing: the host's
    ``MemAvailable`` plus ``SwapFree``, or less where its cgroup or an ancestor has less left
    under its limit (v2 ``memory.max`` less ``memory.current``; v1 ``memory.limit_in_bytes`` less
    ``memory.usage_in_bytes``). None where none of it can be read."""
    found: list[int] = []
    try:
        with open(meminfo) as f:
            info = {k: v.split() for k, _, v in (line.partition(":") for line in f)}
        found.append((int(info["MemAvailable"][0]) + int(info.get("SwapFree", ["0"])[0])) * 1024)
    except (OSError, KeyError, ValueError, IndexError):
        pass
    for d, v2 in _cgroup_dirs("memory", proc_cgroup, root):
        try:
            limit, used = ((_read(d, "memory.max"), _read(d, "memory.current")) if v2 else
                           (_read(d, "memory.limit_in_bytes"), _read(d, "memory.usage_in_bytes")))
        except OSError:
            continue
        if limit.isdigit() and used.isdigit():     # not "max"
            found.append(max(0, int(limit) - int(used)))
    return min(found) if found else None
