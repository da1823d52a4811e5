"""code_tests: run the completion's program against the row's tests in the sandbox (`sandbox.py`).

The program is the last fenced code block of the completion (```python ... ```), or the whole completion
when it has none; the tests are the dataset column `tests_column` (Python source, typically asserts). The score
is 1.0 when the tests ran to their end within the time limit, else 0.0.

The program and its tests run in two processes of the sandbox, so that the program can neither read how its
result is judged nor change it:
- the tester (`TESTER`) reads a nonce and the tests from its standard input (never a file the program could open),
  makes itself non-dumpable (no other process of the sandbox's uid reads its memory or its descriptors through
  /proc), starts the candidate and runs the tests; the names the program defines are proxies there;
- the candidate (`CANDIDATE`) runs the program, with no standard input and its output discarded, and answers each
  call of a proxy over a socket: the arguments and the result cross as Python literals (`repr`, then
  `ast.literal_eval` on the other side), so what a test compares is plain data built by the tester, never an
  object of the program (one whose `__eq__` is always true), and the tester's builtins are its own (a program
  that patches `builtins.len` patches its own process). An exception crosses as its builtin type and message.
- The tester writes the nonce as the last line of its output once the tests ran to their end; a program that
  exits early, hangs, kills the tester or returns something that is not a literal scores 0.

So a test may only call the program's functions with literal arguments and compare literal results (HumanEval's
and MBPP's tests do); a test that passes objects in, mutates an argument in place and reads it back, or reads
an instance's attributes scores 0."""
from __future__ import annotations

import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from rlcu.rewards import sandbox
from rlcu.rewards.base import Reward, completion_text, require_column

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
TESTER = """import ast, builtins, ctypes, os, socket, subprocess, sys
def _tester():
    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    except Exception:
        pass
    nonce = sys.stdin.buffer.readline().strip()
    tests = sys.stdin.buffer.read().decode()
    ours, theirs = socket.socketpair()
    subprocess.Popen([sys.executable, "-I", "candidate.py", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    theirs.close()
    chan = ours.makefile("rwb")
    def ask(message):
        chan.write(repr(message).encode() + b"\\n")
        chan.flush()
        line = chan.readline()
        if not line:
            raise RuntimeError("the program's process ended")
        return ast.literal_eval(line.decode())
    def remote(name):
        def call(*args, **kwargs):
            kind, *rest = ask((name, args, kwargs))
            if kind == "ok":
                return rest[0]
            error = getattr(builtins, rest[0], None)
            if isinstance(error, type) and issubclass(error, Exception):
                raise error(rest[1])
            raise RuntimeError(rest[0] + ": " + rest[1])
        call.__name__ = name
        return call
    kind, names = ask(("__start__", (), {}))
    if kind != "ok":
        sys.exit("the program failed: " + str(names))
    scope = {"__name__": "__main__", "__builtins__": builtins}
    scope.update({name: remote(name) for name in names})
    exec(compile(tests, "tests.py", "exec"), scope)
    sys.stdout.flush()
    os.write(1, b"\\n" + nonce + b"\\n")
_tester()
"""
CANDIDATE = """import ast, os, sys
def _candidate():
    fd = int(sys.argv[1])
    def send(message):
        try:
            line = repr(message)
            ast.literal_eval(line)
        except Exception:
            line = repr(("raise", "TypeError", "the result is not a Python literal"))
        os.write(fd, line.encode() + b"\\n")
    reader = os.fdopen(os.dup(fd), "rb")
    reader.readline()  # the tester's first call: run the program
    scope = {"__name__": "__main__"}
    try:
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), scope)
    except BaseException as e:
        send(("error", type(e).__name__ + ": " + str(e)[:200]))
        return
    send(("ok", [k for k, v in scope.items() if callable(v) and not k.startswith("__")]))
    for line in reader:
        try:
            name, args, kwargs = ast.literal_eval(line.decode())
            send(("ok", scope[name](*args, **kwargs)))
        except Exception as e:
            send(("raise", type(e).__name__, str(e)[:200]))
_candidate()
"""


def ran_to_the_end(result: sandbox.Result, nonce: str) -> bool:
    lines = result.stdout.rstrip("\n").splitlines()
    return result.passed and bool(lines) and lines[-1] == nonce


def extract_program(text: str) -> str:
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


class CodeTests(Reward):
    name = "code_tests"

    def __init__(self, tests_column: str = "tests", timeout: float = 5.0, memory_mb: int = 512,
                 max_processes: int = 32, workers: int = 8, weight: float = 1.0):
        why = sandbox.available()
        if why:
            raise RuntimeError(f"code_tests cannot run here: {why}")
        self.tests_column, self.timeout, self.memory_mb = tests_column, timeout, memory_mb
        self.max_processes, self.workers, self.weight = max_processes, workers, weight

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        tests = require_column(self.name, self.tests_column, kwargs)

        def one(completion, test) -> float | None:
            if test is None:
                return None
            nonce = secrets.token_hex(16)
            result = sandbox.run(TESTER, self.timeout, self.memory_mb, self.max_processes,
                                 files={"solution.py": extract_program(completion_text(completion)),
                                        "candidate.py": CANDIDATE},
                                 stdin=nonce.encode() + b"\n" + str(test).encode())
            return 1.0 if ran_to_the_end(result, nonce) else 0.0

        with ThreadPoolExecutor(max_workers=self.workers) as pool:  # the programs run in parallel processes
            return list(pool.map(one, completions, tests))
