"""The code_tests reward and its sandbox against hostile programs. Each hostile program passes its
"tests" only if its attack worked, so an escape scores 1.0 and fails the test."""
import os
import time

import pytest

from rlcu.rewards import sandbox
from rlcu.rewards.code import CodeTests, extract_program

pytestmark = pytest.mark.skipif(sandbox.available() is not None, reason=str(sandbox.available()))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scores(programs, tests, timeout=2.0):
    reward = CodeTests(timeout=timeout)
    return reward(["p"] * len(programs), [f"```python\n{p}\n```" for p in programs], [[1]] * len(programs),
                  tests=tests)


def test_correct_and_wrong_programs():
    add = "def add(a, b):\n    return a + b"
    assert scores([add, add.replace("+", "-")], ["assert add(2, 3) == 5"] * 2) == [1.0, 0.0]
    assert extract_program("text\n```python\nx = 1\n```\nmore\n```py\ny = 2\n```") == "y = 2\n"


HOSTILE = {
    "infinite loop": ("while True:\n    pass", "pass"),
    "fork bomb": ("import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)",
                  "pass"),
    "memory hog": ("hog = bytearray(8 << 30)", "assert len(hog) == 8 << 30"),
    "write outside its folder": (f"def attack():\n    for path in ('/tmp/rlcu-pwned', '{ROOT}/rlcu-pwned', '/root/rlcu-pwned'):\n"
                                 "        try:\n            open(path, 'w').write('x')\n            return True\n"
                                 "        except OSError:\n            pass\n    return False",
                                 "assert attack()"),
    "network": ("import socket\ndef attack():\n    try:\n        socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                "        return True\n    except OSError:\n        return False", "assert attack()"),
    "environment secrets": ("import os", "assert os.environ.get('RLCU_TEST_SECRET') == 'hunter2'"),
    "raise privileges": ("import os", "os.setuid(0)"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_score_zero_and_leave_no_trace(name, monkeypatch):
    monkeypatch.setenv("RLCU_TEST_SECRET", "hunter2")
    program, test = HOSTILE[name]
    start = time.perf_counter()
    assert scores([program], [test]) == [0.0]
    assert time.perf_counter() - start < 2.0 + 2.0, "the time limit did not hold"
    for path in ("/tmp/rlcu-pwned", f"{ROOT}/rlcu-pwned", "/root/rlcu-pwned"):
        assert not os.path.exists(path)
    time.sleep(0.2)
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == sandbox.NOBODY and _state(p) != "Z"]
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
