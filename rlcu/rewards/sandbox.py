"""Run an untrusted Python program in isolation (Linux, as root): a private, size-limited working folder,
an empty environment, no network, a read-only view of the system's folders (/usr, /lib, /bin and the
interpreter) and nothing else of the host (every other top-level folder is empty), a fresh /proc that shows only
its own processes, a uid of its own, and limits on time, memory, processes, file size and open files. The
whole sandbox is killed on timeout.

The set-up runs in a fresh single-threaded helper process (`_ISOLATE` below, started with `python -c`):
it joins the program's control groups (memory and process limits over everything the program starts,
where cgroups are writable: `sandbox_limits.py`), enters new network, mount and pid namespaces, remounts
every file system read-only, mounts private size-limited tmpfs on /tmp (the working folder, a copy of
the given files) and /dev/shm, then forks the program's first process, which mounts /proc for its pid
namespace, drops to the sandbox's uid and starts the program. When that process ends or is killed, the
kernel ends everything it started, and the tmpfs go with the namespace. Each sandbox has its own uid, so
a fork bomb meets its own process limit and never its neighbours'."""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from rlcu.rewards.sandbox_limits import ControlGroup, give_uid, remove_groups_of_dead_callers, take_uid

TMPFS_MB = 64  # the program's /tmp (its working folder) and /dev/shm, each
# the base interpreter, as (prefix, path inside it): a virtual environment's packages are not needed
PYTHON = f"{sys.base_prefix}|{os.path.relpath(os.path.realpath(sys.executable), sys.base_prefix)}"

_ISOLATE = r"""
import ctypes, os, resource, sys
workdir, seconds, memory, processes, python, uid, tmpfs_mb, caller = sys.argv[1:9]
KEEP = {"usr", "lib", "lib32", "lib64", "libx32", "bin", "sbin", "proc", "sys", "dev", "tmp"}
seconds, memory, processes, uid, tmpfs_mb = int(seconds), int(memory), int(processes), int(uid), int(tmpfs_mb)
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, SIGKILL = 1, 9
libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # a killed caller takes this helper with it
if os.getppid() != int(caller):  # the caller died before that
    os._exit(98)
def check(ok, what):
    if not ok:
        sys.stderr.write(f"sandbox: {what} failed (errno {ctypes.get_errno()})\n"); os._exit(97)
for procs in sys.argv[9:]:  # the program's control groups: every process it starts is counted there
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
check(libc.unshare(0x40000000 | 0x00020000 | 0x20000000) == 0, "unshare(network, mount, pid)")
check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0, "making mounts private")
source = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)  # the given files, read before /tmp is covered
points = [line.split()[4] for line in open("/proc/self/mountinfo")]
for point in sorted(set(points), key=len):
    if point.startswith(("/proc", "/sys", "/dev")):
        continue
    libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)  # best effort per mount
for point in ("/tmp", "/dev/shm"):
    if os.path.isdir(point):
        options = f"size={tmpfs_mb}m,mode=1777,nr_inodes=4096".encode()
        check(libc.mount(b"tmpfs", point.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0, f"a private {point}")
home = "/tmp/work"
os.mkdir(home, 0o700)
for name in os.listdir(source):
    with open(os.open(name, os.O_RDONLY, dir_fd=source), "rb") as src, open(os.path.join(home, name), "wb") as dst:
        dst.write(src.read())
os.close(source)
# the interpreter may live where the sandbox's uid cannot reach (/root/.pyenv): show it read-only
prefix, relative = python.split("|")
target = os.path.join(home, ".python")
os.mkdir(target)
check(libc.mount(prefix.encode(), target.encode(), None, MS_BIND | MS_REC, None) == 0, "binding the interpreter")
libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
python = os.path.join(target, relative)
# every other top-level folder (the host's /etc, /home, /root, /var, /run, the project's checkout...) becomes an
# empty read-only tmpfs: their files and unix sockets are out of reach; the system's own folders stay, read-only,
# and the interpreter's prefix is shown again at its own path, where its libraries are looked for
for name in os.listdir("/"):
    point = "/" + name
    if name in KEEP or os.path.islink(point) or not os.path.isdir(point):
        continue
    check(libc.mount(b"tmpfs", point.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=755") == 0,
          f"covering {point}")
    if prefix == point or prefix.startswith(point + "/"):
        os.makedirs(prefix, exist_ok=True)
        check(libc.mount(target.encode(), prefix.encode(), None, MS_BIND | MS_REC, None) == 0,
              "showing the interpreter")
        libc.mount(None, prefix.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    libc.mount(None, point.encode(), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
for path in [home] + [os.path.join(home, n) for n in os.listdir(home) if n != ".python"]:
    os.chown(path, uid, uid)
child = os.fork()  # the first process of the new pid namespace: when it ends, the kernel ends all it started
if child == 0:
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0, "a fresh /proc")
    for limit, value in ((resource.RLIMIT_CPU, seconds), (resource.RLIMIT_AS, memory),
                         (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_FSIZE, 16 << 20),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # after setuid, which clears it: the helper's death ends all
    os.chdir(home)
    os.execve(python, [python, "-I", "-S", "program.py"], {})
_, status = os.waitpid(child, 0)
os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


@dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


LEFTOVER_PREFIX = "rlcu-sandbox-"  # + the caller's pid: working folders and control groups are named so


@functools.cache
def sweep_leftovers() -> None:
    """Once a process: the working folders and control groups of callers that died without removing them (a
    trainer killed with SIGKILL). Their sandboxes died with them (each helper and each program's first process
    has the parent-death signal)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if _dead_caller(name) and os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    remove_groups_of_dead_callers(_dead_caller)


def _dead_caller(name: str) -> bool:
    """Whether `name` is a sandbox's folder or group whose caller no longer runs."""
    if not name.startswith(LEFTOVER_PREFIX):
        return False
    pid = name[len(LEFTOVER_PREFIX):].split("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when programs can be isolated here (tried once with a harmless program), else why not."""
    if not sys.platform.startswith("linux"):
        return "the code sandbox needs Linux (namespaces and resource limits)"
    if os.geteuid() != 0:
        return ("the code sandbox needs root to isolate programs (network and mount namespaces, dropping to an "
                "unprivileged uid); run training as root, as in a container")
    probe = _run("print('ok')", timeout=10.0, memory_mb=512, max_processes=32)
    if not probe.passed or probe.stdout.strip() != "ok":
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"this machine does not allow the sandbox's isolation ({last}); a container may need CAP_SYS_ADMIN"
    return None


def run(source: str, timeout: float = 5.0, memory_mb: int = 512, max_processes: int = 32,
        files: dict[str, str] | None = None, stdin: bytes | None = None) -> Result:
    """Run `source` as program.py beside `files` ({name: text}) in the sandbox's working folder, with
    `stdin` as its standard input."""
    why = available()
    if why:
        raise RuntimeError(why)
    return _run(source, timeout, memory_mb, max_processes, files or {}, stdin)


def _run(source: str, timeout: float, memory_mb: int, max_processes: int, files: dict[str, str] | None = None,
         stdin: bytes | None = None) -> Result:
    sweep_leftovers()
    workdir = tempfile.mkdtemp(prefix=f"{LEFTOVER_PREFIX}{os.getpid()}-")
    uid, group = take_uid(), ControlGroup(memory_mb << 20, max_processes)
    try:
        for name, text in {**(files or {}), "program.py": source}.items():
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)
        cpu = max(1, int(timeout) + 1)
        args = [workdir, str(cpu), str(memory_mb << 20), str(max_processes), PYTHON, str(uid), str(TMPFS_MB),
                str(os.getpid())]
        proc = subprocess.Popen([sys.executable, "-I", "-c", _ISOLATE, *args, *group.procs], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, start_new_session=True)
        out, err = _Tail(proc.stdout), _Tail(proc.stderr)
        threading.Thread(target=_feed, args=(proc.stdin, stdin or b""), daemon=True).start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return Result(None, "", "", True)
        return Result(proc.returncode, out.text(), err.text(), False)
    finally:
        group.remove()
        give_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)


KEEP_BYTES = 64 << 10  # of each output stream, its end: what a chatty program writes beyond is read and dropped


class _Tail:
    """Drains a pipe in a thread of its own, keeping its last KEEP_BYTES: a program that writes gigabytes costs
    the caller no memory and cannot stall on a full pipe."""

    def __init__(self, stream):
        self.data, self.stream = bytearray(), stream
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        fd = self.stream.fileno()
        while chunk := os.read(fd, 1 << 16):
            self.data += chunk
            if len(self.data) > 2 * KEEP_BYTES:
                del self.data[:-KEEP_BYTES]

    def text(self) -> str:
        """Its last 4,000 characters, once the pipe is closed (the sandbox's processes ended with its first)."""
        self.thread.join(1.0)
        return bytes(self.data[-KEEP_BYTES:]).decode(errors="replace")[-4000:]


def _feed(pipe, data: bytes) -> None:
    """The program's standard input, written apart from the waiting: one that never reads it cannot block us."""
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass


def _kill(proc: subprocess.Popen) -> None:
    """The program (its pid namespace with it), then the helper's process group; nothing is waited on
    that a straggler could hold open."""
    try:
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    except OSError:
        children = []
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        pipe.close()
