"""What one sandboxed program may take, as a whole: its own uid (so per-uid process limits of one program
never starve another) and, where the kernel's cgroups are writable, one control group per program with a
memory limit and a process limit over every process it starts."""
from __future__ import annotations

import itertools
import os
import signal
import threading
import time

UID_BASE = 1_900_000_000  # far above any real account; each running sandbox takes one uid of its own
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_counter = itertools.count()


def process_uids() -> range:
    """The block of sandbox uids this process takes from: the process id keeps processes' sandboxes apart."""
    start = UID_BASE + (os.getpid() % 100_000) * 1000
    return range(start, start + 1000)


def take_uid() -> int:
    """A uid of this process's block that no other sandbox of this process uses now."""
    with _uid_lock:
        while True:
            uid = process_uids()[next(_counter) % 1000]
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def give_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup (v1 hierarchy of `controller`, or '' for v2) as a path under /sys/fs/cgroup."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(",") or (controller == "" and names == ""):
            return path
    return None


def _v1_dirs() -> list[tuple[str, str]] | None:
    """(folder to create the group in, controller) for the v1 memory and pids hierarchies, if both exist."""
    found = []
    for controller in ("memory", "pids"):
        own = _own_cgroup(controller)
        root = f"/sys/fs/cgroup/{controller}"
        if own is None or not os.path.isdir(root):
            return None
        found.append((root + own.rstrip("/"), controller))
    return found


def _v2_dir() -> str | None:
    """The v2 folder to create groups in, where memory and pids can be enabled for children."""
    if not os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        return None
    own = _own_cgroup("")
    if own is None:
        return None
    base = "/sys/fs/cgroup" + own.rstrip("/")
    try:
        if not {"memory", "pids"} <= set(open(f"{base}/cgroup.controllers").read().split()):
            return None
        with open(f"{base}/cgroup.subtree_control", "w") as f:
            f.write("+memory +pids")
    except OSError:
        return None
    return base


class ControlGroup:
    """One program's cgroup(s); `procs` are the files the program's first process writes its pid to."""

    def __init__(self, memory_bytes: int, max_processes: int):
        self.dirs: list[str] = []
        name = f"rlcu-sandbox-{os.getpid()}-{next(_counter)}"
        try:
            v2 = _v2_dir()
            if v2 is not None:
                limits = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": max_processes}
                self._make(f"{v2}/{name}", limits)
            else:
                for base, controller in _v1_dirs() or []:
                    limits = ({"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes}
                              if controller == "memory"
                              else {"pids.max": max_processes})
                    self._make(f"{base}/{name}", limits)
        except OSError:
            self.remove()
            self.dirs = []

    def _make(self, path: str, limits: dict[str, int]) -> None:
        os.mkdir(path)
        self.dirs.append(path)
        for key, value in limits.items():
            try:
                with open(f"{path}/{key}", "w") as f:
                    f.write(str(value))
            except FileNotFoundError:  # memory.swap.max and the like where the kernel has no swap accounting
                if key in ("memory.max", "memory.limit_in_bytes", "pids.max"):
                    raise

    @classmethod
    def existing(cls, dirs: list[str]) -> "ControlGroup":
        """Groups made earlier (by a caller that died), to remove."""
        group = cls.__new__(cls)
        group.dirs = list(dirs)
        return group

    @property
    def procs(self) -> list[str]:
        return [f"{d}/cgroup.procs" for d in self.dirs]

    def remove(self) -> None:
        """Kill whatever is left in the group, then remove it."""
        for path in reversed(self.dirs):
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    _kill_all(f"{path}/cgroup.procs")
                    time.sleep(0.02)


def remove_groups_of_dead_callers(dead) -> None:
    """Every sandbox group (here, v2 or v1) whose name `dead(name)` says belongs to a caller that died."""
    bases = [_v2_dir()] if os.path.isfile("/sys/fs/cgroup/cgroup.controllers") else [b for b, _ in _v1_dirs() or []]
    for base in filter(None, bases):
        try:
            names = [n for n in os.listdir(base) if dead(n)]
        except OSError:
            continue
        ControlGroup.existing([os.path.join(base, n) for n in names]).remove()


def _kill_all(procs_file: str) -> None:
    try:
        pids = open(procs_file).read().split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def whole_sandbox_limits() -> bool:
    """Whether this machine limits a program's memory and processes as a whole (writable cgroups)."""
    group = ControlGroup(64 << 20, 8)
    try:
        return bool(group.dirs)
    finally:
        group.remove()
