"""code_tests: run the completion's program against the row's tests in the sandbox (`sandbox.py`).

The program is the last fenced code block of the completion (```python ... ```), or the whole completion
when it has none; the tests are the dataset column `tests_column` (Python source, typically asserts),
appended to the program. The score is 1.0 when the program and its tests exit cleanly within the time
limit, else 0.0."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from rlcu.rewards import sandbox
from rlcu.rewards.base import Reward, completion_text, require_column

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


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
            source = extract_program(completion_text(completion)) + "\n\n" + str(test) + "\n"
            result = sandbox.run(source, self.timeout, self.memory_mb, self.max_processes)
            return 1.0 if result.passed else 0.0

        with ThreadPoolExecutor(max_workers=self.workers) as pool:  # the programs run in parallel processes
            return list(pool.map(one, completions, tests))
