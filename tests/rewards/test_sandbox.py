"""The code_tests reward and its sandbox against hostile programs. Each hostile program passes its
"tests" only if its attack worked, so an escape scores 1.0 and fails the test."""
import os
import time

import pytest

from rlcu.rewards import sandbox
from rlcu.rewards.code import CodeTests, extract_program
from rlcu.rewards.sandbox_limits import process_uids, whole_sandbox_limits

pytestmark = pytest.mark.skipif(sandbox.available() is not None, reason=str(sandbox.available()))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scores(programs, tests, timeout=2.0):
    reward = CodeTests(timeout=timeout)
    return reward(["p"] * len(programs), [f"```python\n{p}\n```" for p in programs], [[1]] * len(programs),
                  tests=tests)


def test_correct_and_wrong_programs():
    add = "def add(a, b):\n    return a + b"
    assert scores([add, add.replace("+", "-")], ["assert add(2, 3) == 5"] * 2) == [1.0, 0.0]
    # HumanEval's form, literals of every kind, an expected exception, a program that prints and uses helpers
    program = ("import math\ndef _norm(v):\n    return math.sqrt(sum(x * x for x in v))\n"
               "def stats(v, scale=1):\n    print('working')\n"
               "    return {'norm': _norm(v) * scale, 'sorted': sorted(v),"
               " 'pair': (min(v), max(v)), 'set': set(v), 'text': 'a\\nb'}\n"
               "def pick(d, k):\n    return d[k]")
    tests = ("def check(candidate):\n    out = candidate([3, 4], scale=2)\n    assert out['norm'] == 10.0\n"
             "    assert out['sorted'] == [3, 4] and out['pair'] == (3, 4) and out['set'] == {3, 4}\n"
             "    assert out['text'] == 'a\\nb'\n"
             "check(stats)\ntry:\n    pick({'a': 1}, 'b')\nexcept KeyError:\n    pass\nelse:\n    assert False\n")
    assert scores([program, program.replace("* scale", "")], [tests] * 2) == [1.0, 0.0]
    assert extract_program("text\n```python\nx = 1\n```\nmore\n```py\ny = 2\n```") == "y = 2\n"


HOSTILE = {
    "infinite loop": ("while True:\n    pass", "pass"),
    "fork bomb": ("import os, time\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        time.sleep(0.01)", "pass"),
    "memory hog": ("hog = bytearray(8 << 30)", "assert len(hog) == 8 << 30"),
    # its folder and /tmp are one private tmpfs: every other path is read-only
    "write outside its folder": ("def attack():\n"
                                 f"    for path in ('{ROOT}/rlcu-pwned', '/root/rlcu-pwned', '/etc/rlcu-pwned'):\n"
                                 "        try:\n            open(path, 'w').write('x')\n            return True\n"
                                 "        except OSError:\n            pass\n    return False",
                                 "assert attack()"),
    "network": ("import socket\ndef attack():\n    try:\n        socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                "        return True\n    except OSError:\n        return False", "assert attack()"),
    "environment secrets": ("import os", "assert os.environ.get('RLCU_TEST_SECRET') == 'hunter2'"),
    "raise privileges": ("import os", "os.setuid(0)"),
    # a wrong program that leaves before its tests run: an exit code of 0 is no pass
    "sys.exit(0) before the tests": ("import sys\nsys.exit(0)", "assert False"),
    "os._exit(0) before the tests": ("import os\nos._exit(0)", "assert False"),
    "raise SystemExit before the tests": ("raise SystemExit", "assert False"),
    "exit(0) in an atexit hook": ("import atexit, os\natexit.register(lambda: os._exit(0))", "assert False"),
    "fill /tmp": ("def attack():\n    try:\n        with open('/tmp/fill', 'wb') as f:\n"
                  "            for _ in range(300):\n                f.write(bytes(1 << 20))\n        return True\n"
                  "    except OSError:\n        return False", "assert attack()"),
    # every top-level folder but the system's (/usr, /lib, /bin, ...) is an empty tmpfs: the host's /etc, the checkout
    "read host files": ("import os\ndef attack():\n    found = []\n"
                        f"    for path in ('/etc/passwd', '{ROOT}/README.md', '{ROOT}/.git/HEAD', '/var'):\n"
                        "        try:\n            found.append(bool(os.listdir(path)) if os.path.isdir(path) "
                        "else bool(open(path).read()))\n        except OSError:\n            pass\n"
                        "    return any(found)", "assert attack()"),
    # a wrong program that fakes the verdict (each scored 1.0 when program and tests shared one process)
    "read the nonce from the harness's frames": (
        "import os, sys\nf = sys._getframe()\nwhile f is not None:\n"
        "    for v in list(f.f_locals.values()):\n"
        "        if isinstance(v, bytes) and len(v) == 32:\n"
        "            os.write(1, b'\\n' + v + b'\\n')\n            os._exit(0)\n    f = f.f_back",
        "assert False"),
    "read the nonce from another process's memory": (
        "import os, re\ndef attack():\n    for pid in os.listdir('/proc'):\n        try:\n"
        "            maps = open(f'/proc/{pid}/maps').read().splitlines()\n"
        "            mem = open(f'/proc/{pid}/mem', 'rb')\n        except OSError:\n            continue\n"
        "        for line in maps:\n            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "            try:\n                mem.seek(lo)\n                data = mem.read(hi - lo)\n"
        "            except (OSError, OverflowError, ValueError):\n                continue\n"
        "            for hit in re.findall(rb'[0-9a-f]{32}', data):\n"
        "                for out in (1, f'/proc/{os.getppid()}/fd/1'):\n"
        "                    try:\n                        fd = out if out == 1 else os.open(out, os.O_WRONLY)\n"
        "                        os.write(fd, b'\\n' + hit + b'\\n')\n"
        "                    except OSError:\n                        pass\n"
        "    os._exit(0)\nattack()", "assert False"),
    "an always-equal result": ("class Any:\n    def __eq__(self, other):\n        return True\n"
                               "def add(a, b):\n    return Any()", "assert add(2, 3) == 5"),
    "patched builtins": ("import builtins\nbuiltins.len = lambda x: 3\ndef f(x):\n    return [x]",
                         "assert len(f(0)) == 3"),
    "read the tests to answer them": ("import re\ndef add(a, b):\n    for path in ('solution.py', 'program.py', "
                                      "'tests.py', '/proc/self/fd/0'):\n        try:\n"
                                      "            m = re.search(r'== (\\d+)', open(path).read())\n"
                                      "        except OSError:\n            continue\n"
                                      "        if m:\n            return int(m.group(1))",
                                      "assert add(2, 3) == 41"),
    "read other processes' command lines": (
        "import os\ndef attack():\n    lines = []\n    for pid in os.listdir('/proc'):\n        try:\n"
        "            lines.append(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
        "        except OSError:\n            pass\n"
        "    return any(b'pytest' in line or b'rlcu' in line for line in lines)", "assert attack()"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_score_zero_and_leave_no_trace(name, monkeypatch):
    monkeypatch.setenv("RLCU_TEST_SECRET", "hunter2")
    program, test = HOSTILE[name]
    start = time.perf_counter()
    assert scores([program], [test]) == [0.0]
    assert time.perf_counter() - start < 2.0 + 2.0, "the time limit did not hold"
    for path in (f"{ROOT}/rlcu-pwned", "/root/rlcu-pwned", "/etc/rlcu-pwned"):
        assert not os.path.exists(path)
    time.sleep(0.2)
    ours = process_uids()  # this process's sandboxes only: other test processes run sandboxes too
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) in ours and _state(p) != "Z"]
    assert not alive, f"sandboxed processes outlived the reward: {alive}"


def _uid(pid):
    try:
        return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("Uid:")).split()[1])
    except (OSError, StopIteration):
        return -1


def _state(pid):
    try:
        return next(line for line in open(f"/proc/{pid}/status") if line.startswith("State:")).split()[1]
    except (OSError, StopIteration):
        return "?"


def test_a_fork_bomb_does_not_starve_its_neighbours():
    """One fork bomb among 16 programs: every correct neighbour still scores 1.0 (each sandbox has a uid and
    a process limit of its own)."""
    add = "def add(a, b):\n    return a + b"
    bomb = HOSTILE["fork bomb"][0]
    programs = [bomb] + [add] * 15
    got = scores(programs, ["pass"] + ["assert add(2, 3) == 5"] * 15)
    assert got[0] == 1.0 or got[0] == 0.0  # the bomb's own "test" is `pass`: it may run out its time
    assert got[1:] == [1.0] * 15


def test_files_in_tmp_and_dev_shm_do_not_outlive_the_program():
    program = ("import os\nfor d in ('/tmp', '/dev/shm'):\n    if os.path.isdir(d):\n"
               "        open(os.path.join(d, 'rlcu-left-behind'), 'w').write('x')")
    assert scores([program], ["import os\nassert os.path.exists('/tmp/rlcu-left-behind')"]) == [1.0]
    assert not os.path.exists("/tmp/rlcu-left-behind") and not os.path.exists("/dev/shm/rlcu-left-behind")


@pytest.mark.skipif(not whole_sandbox_limits(), reason="no writable cgroups here: memory is limited per process")
def test_memory_is_limited_for_the_sandbox_as_a_whole():
    """Five processes of 400 MB each under memory_mb=512: the sandbox's limit, not each process's."""
    program = ("import os, time\ndef attack():\n    kids = []\n    for _ in range(5):\n        pid = os.fork()\n"
               "        if pid == 0:\n            hog = b'x' * (400 << 20)  # every page written\n"
               "            time.sleep(0.5)\n"
               "            os._exit(0)\n        kids.append(pid)\n"
               "    return all(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) == 0 for k in kids)")
    reward = CodeTests(timeout=10.0, memory_mb=512)
    assert reward(["p"], [f"```python\n{program}\n```"], [[1]], tests=["assert attack()"]) == [0.0]


def test_a_host_unix_socket_is_out_of_reach(tmp_path):
    """A world-writable unix socket in /var/tmp, as the hostile newcomer found one answering."""
    import socket
    import threading

    path = f"/var/tmp/rlcu-test-{os.getpid()}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen()
    server.settimeout(5)
    reached = []
    threading.Thread(target=lambda: reached.append(_accepted(server)), daemon=True).start()
    program = ("import socket\ndef attack():\n    try:\n        s = socket.socket(socket.AF_UNIX)\n"
               f"        s.connect('{path}')\n        s.sendall(b'x')\n        return True\n"
               "    except OSError:\n        return False")
    try:
        assert scores([program], ["assert attack()"]) == [0.0]
        time.sleep(0.5)
        assert reached in ([], [False])
    finally:
        server.close()
        os.unlink(path)


def _accepted(server) -> bool:
    try:
        server.accept()
        return True
    except OSError:
        return False


def test_a_chatty_program_costs_the_caller_no_memory_and_keeps_its_time_limit():
    """1 GB written to standard output and as much to standard error within a 4 s limit: the process that runs it
    grows by well under the 2 GB it once buffered, the run keeps its limit, and the end of each stream comes back."""
    import json
    import subprocess
    import sys

    chatty = ("import os\nchunk = b'x' * (1 << 20)\nfor _ in range(1024):\n    os.write(1, chunk)\n"
              "    os.write(2, chunk)\nos.write(1, b'\\nlast line\\n')\nos.write(2, b'\\nlast error\\n')")
    # the probe's own high-water mark (VmHWM starts anew at exec; getrusage's ru_maxrss keeps the forking worker's)
    probe = ("import json, time\nfrom rlcu.rewards import sandbox\n"
             "peak = lambda: int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) // 1024\n"
             "before, start = peak(), time.perf_counter()\n"
             f"r = sandbox.run({chatty!r}, timeout=4.0)\n"
             "print(json.dumps([r.timed_out, r.stdout.splitlines()[-1:], r.stderr.splitlines()[-1:], "
             "time.perf_counter() - start, peak() - before]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    timed_out, last, last_error, seconds, grown_mb = json.loads(out.stdout.splitlines()[-1])
    assert seconds < 4.0 + 2.0 and grown_mb < 200, (seconds, grown_mb)
    assert timed_out or (last, last_error) == (["last line"], ["last error"])


def test_a_killed_caller_leaves_no_sandboxed_process_and_its_folders_and_groups_are_swept():
    """SIGKILL to a process that runs a sandboxed program: the program and its helper die with it (the
    parent-death signal); its working folder and control group, which it could not remove, go at the next
    sandbox's start in another process."""
    import glob
    import signal
    import subprocess
    import sys
    import tempfile

    from rlcu.rewards.sandbox_limits import UID_BASE

    # the caller's first sandbox is the probe of `available()`, which ends at once: the test waits for the
    # program after it, or it would take the probe's uid for the program's and find it gone
    caller = subprocess.Popen([sys.executable, "-c", "import sys\nfrom rlcu.rewards import sandbox\n"
                               "print('probed', sandbox.available(), flush=True)\n"
                               "r = sandbox.run('import time\\nwhile True:\\n    time.sleep(0.05)', timeout=60)\n"
                               "print('the sandbox returned', r, file=sys.stderr)"], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    uids = range(UID_BASE + (caller.pid % 100_000) * 1000, UID_BASE + (caller.pid % 100_000) * 1000 + 1000)
    sandboxed = lambda: [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) in uids]  # noqa: E731
    assert caller.stdout.readline().strip() == "probed None"  # blocks while it imports torch: minutes under load
    deadline = time.time() + 60
    while not sandboxed() and caller.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert sandboxed(), f"the sandboxed program did not start (its caller's exit status: {caller.poll()})"
    folders = glob.glob(f"{tempfile.gettempdir()}/{sandbox.LEFTOVER_PREFIX}{caller.pid}-*")
    assert folders
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    caller.stdout.close()
    deadline = time.time() + 5
    while [p for p in sandboxed() if _state(p) != "Z"] and time.time() < deadline:
        time.sleep(0.05)
    assert not [p for p in sandboxed() if _state(p) != "Z"], "sandboxed processes outlived their caller"
    assert all(os.path.isdir(f) for f in folders)  # nothing removed them yet
    sandbox.sweep_leftovers.__wrapped__()
    assert not any(os.path.exists(f) for f in folders)
    groups = glob.glob(f"/sys/fs/cgroup/**/{sandbox.LEFTOVER_PREFIX}{caller.pid}-*", recursive=True)
    assert not groups, groups
