"""The set-up check of a run's training prompts (GRPOModule.on_fit_start): each prompt rendered by the chat
template and tokenised one call at a time, as before 424ac4a, against `encode_prompts`' one call for all. The
calculator recipe's prompts on the embedded SmolLM2 tokenizer; prints one JSON line (docs/benchmarks.md).
    python3 benchmarks/prompt_check.py [N, default 20000: the recipe's n] [ROUNDS, default 3]"""
import json
import sys
import time

from rlcu.data import tasks
from rlcu.data.prompts import encode_prompts, prompt_text
from rlcu.models.loading import load_tokenizer, resolve_source


def one_by_one(tok, prompts):
    return [list(tok(prompt_text(tok, p), add_special_tokens=False)["input_ids"]) for p in prompts]


def seconds(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main(n: int = 20000, rounds: int = 3) -> None:
    tok = load_tokenizer(resolve_source("smollm2-135m-instruct"))
    prompts = [row["prompt"] for row in tasks.calculator(n=n)]
    before, after = [], []
    for _ in range(rounds):  # alternating, so that a slower spell of the machine falls on both
        t, old = seconds(one_by_one, tok, prompts)
        before.append(round(t, 2))
        t, new = seconds(encode_prompts, tok, prompts)
        after.append(round(t, 2))
        assert old == new, "encode_prompts gave other ids"
    print(json.dumps({"prompts": n, "one_by_one_s": before, "encode_prompts_s": after}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
