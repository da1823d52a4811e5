"""code_tests: run the completion's program against the row's tests in the sandbox (`sandbox.py`).

The program is the last fenced code block of the completion (```python ... ```), or the whole completion
when it has none; the tests are the dataset column `tests_column` (Python source, typically asserts),
appended to the program. The score is 1.0 when the program and its tests ran to their end within the
time limit, else 0.0.

"Ran to the end" is checked, not inferred from the exit code: a small harness runs program + tests and
then writes a nonce that the reward gave it on standard input, and the reward wants that nonce as the last
line of the output. A program that calls `sys.exit(0)` or `os._exit(0)` before the tests, or raises
`SystemExit`, never gets there. (A program written to dig the nonce out of the harness's frames could
still fake it; the sandbox keeps such a program from harming anything else.)"""
from __future__ import annotations

import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from rlcu.rewards import sandbox
from rlcu.rewards.base import Reward, completion_text, require_column

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
# runs solution.py (program + tests) as __main__, then writes the nonce it read first; the nonce lives only in
# a local of the harness, never in the solution's globals
HARNESS = """import os, sys
def _harness():
    nonce = sys.stdin.buffer.readline().strip()
    with open("solution.py") as f:
        code = compile(f.read(), "solution.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    sys.stdout.flush()
    os.write(1, b"\\n" + nonce + b"\\n")
_harness()
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
            solution = extract_program(completion_text(completion)) + "\n\n" + str(test) + "\n"
            nonce = secrets.token_hex(16)
            result = sandbox.run(HARNESS, self.timeout, self.memory_mb, self.max_processes,
                                 files={"solution.py": solution}, stdin=nonce.encode() + b"\n")
            return 1.0 if ran_to_the_end(result, nonce) else 0.0

        with ThreadPoolExecutor(max_workers=self.workers) as pool:  # the programs run in parallel processes
            return list(pool.map(one, completions, tests))
