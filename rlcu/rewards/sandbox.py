"""Run an untrusted Python program in isolation (Linux, as root): a private working folder, an empty
environment, no network, a read-only view of every other file, an unprivileged uid, and limits on
time, memory, processes, file size and open files. The whole process group is killed on timeout.

The set-up runs in a fresh single-threaded helper process (`_ISOLATE` below, started with `python -c`),
which enters new network, mount and pid namespaces, remounts every file system read-only except the
working folder, drops to uid/gid 65534 and only then starts the program as the first process of its pid
namespace: when the program ends or is killed, the kernel ends everything it started. A fork bomb meets
the process limit (counted per uid, which is why the uid is dropped: root is exempt)."""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

NOBODY = 65534
# the base interpreter, as (prefix, path inside it): a virtual environment's packages are not needed
PYTHON = f"{sys.base_prefix}|{os.path.relpath(os.path.realpath(sys.executable), sys.base_prefix)}"

_ISOLATE = r"""
import ctypes, os, resource, sys
workdir, seconds, memory, processes, python = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        sys.stderr.write(f"sandbox: {what} failed (errno {ctypes.get_errno()})\n"); os._exit(97)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
check(libc.unshare(0x40000000 | 0x00020000 | 0x20000000) == 0, "unshare(network, mount, pid)")
check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0, "making mounts private")
points = [line.split()[4] for line in open("/proc/self/mountinfo")]
for point in sorted(set(points), key=len):
    if point.startswith(("/proc", "/sys", "/dev")):
        continue
    libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)  # best effort per mount
check(libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None) == 0, "binding the working folder")
check(libc.mount(None, workdir.encode(), None, MS_REMOUNT | MS_BIND, None) == 0, "making it writable")
# the interpreter may live where uid 65534 cannot reach (/root/.pyenv): show it read-only inside the folder
prefix, relative = python.split("|")
target = os.path.join(workdir, ".python")
os.mkdir(target)
check(libc.mount(prefix.encode(), target.encode(), None, MS_BIND | MS_REC, None) == 0, "binding the interpreter")
libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
python = os.path.join(target, relative)
for limit, value in ((resource.RLIMIT_CPU, seconds), (resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, processes),
                     (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.chdir(workdir)
child = os.fork()  # the first process of the new pid namespace: when it ends, the kernel ends all it started
if child == 0:
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


def run(source: str, timeout: float = 5.0, memory_mb: int = 512, max_processes: int = 32) -> Result:
    why = available()
    if why:
        raise RuntimeError(why)
    return _run(source, timeout, memory_mb, max_processes)


def _run(source: str, timeout: float, memory_mb: int, max_processes: int) -> Result:
    workdir = tempfile.mkdtemp(prefix="rlcu-sandbox-")
    try:
        with open(os.path.join(workdir, "program.py"), "w") as f:
            f.write(source)
        os.chown(workdir, NOBODY, NOBODY)
        os.chmod(workdir, 0o700)
        cpu = max(1, int(timeout) + 1)
        proc = subprocess.Popen([sys.executable, "-I", "-c", _ISOLATE, workdir, str(cpu), str(memory_mb << 20),
                                 str(max_processes), PYTHON], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={}, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            return Result(proc.returncode, out.decode(errors="replace")[-4000:], err.decode(errors="replace")[-4000:],
                          False)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return Result(None, "", "", True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
