"""`rlcu generate`: run a model with any rollout backend on a JSONL of prompts and write completions,
token ids, logprobs and finish reasons as JSONL (for evaluation and for debugging the engine).

Input rows: {"prompt": "text"}, {"prompt": [chat messages]}, {"messages": [chat messages]} or
{"prompt_token_ids": [ids]} (vLLM's name: token ids as they are, for a model without a tokenizer too); other
fields are copied to the output."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def read_prompts(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not any(k in row for k in ("prompt", "messages", "prompt_token_ids")):
            raise ValueError(f"{path}:{n} needs a 'prompt' (text or chat messages), a 'messages' or a "
                             "'prompt_token_ids' field")
        ids = row.get("prompt_token_ids")
        if ids is not None and not (isinstance(ids, list) and ids and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"{path}:{n}: 'prompt_token_ids' must be a non-empty list of token ids (ints >= 0)")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows


class Progress:
    """A line on stderr every few seconds while completions end (on a backend that reports them)."""

    def __init__(self, total: int, every: float = 5.0):
        self.total, self.every, self.done = total, every, 0
        self.start = self.last = time.perf_counter()

    def one(self, turn) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            print(f"rlcu generate: {self.done}/{self.total} completions, {now - self.start:.0f} s", file=sys.stderr)


class StopOnSignal:
    """SIGTERM or Ctrl-C while generating: the rollout stops between two decode steps."""

    def __init__(self):
        self.signal: signal.Signals | None = None
        self._previous: dict = {}

    def asked(self) -> bool:
        return self.signal is not None

    def _on(self, signum, frame) -> None:
        self.signal = signal.Signals(signum)

    def __enter__(self) -> "StopOnSignal":
        self._previous = {s: signal.signal(s, self._on) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlcu generate", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="smollm2-135m-instruct", help="HF folder, hub id, .gguf file or embedded name")
    p.add_argument("--input", required=True, type=Path,
                   help="JSONL of prompts: rows with 'prompt' (text or chat), 'messages' or 'prompt_token_ids'")
    p.add_argument("--output", required=True, type=Path, help="JSONL to write")
    p.add_argument("--rollout", default="native", help="rollout backend: a plugin name or import path")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--max_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--min_p", type=float, default=0.0)
    p.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or completion (vLLM's meaning; 1.0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    return p


def prompt_token_ids(rows: list[dict], tok, vocab_size: int, args) -> list[list[int]]:
    """Each row's prompt as token ids: its 'prompt_token_ids' as they are, else its text or chat encoded by the
    tokenizer (chat through its template)."""
    from rlcu.data.prompts import encode_prompts

    texts = [(i, r.get("prompt", r.get("messages"))) for i, r in enumerate(rows) if "prompt_token_ids" not in r]
    if texts and tok is None:
        raise ValueError(f"{args.model} has no tokenizer, so the text prompts of {args.input} (row {texts[0][0] + 1} "
                         "the first) cannot be encoded: add the tokenizer's files to the model's folder, or give each "
                         "row 'prompt_token_ids' (a list of token ids) instead")
    encoded = dict(zip((i for i, _ in texts), encode_prompts(tok, [t for _, t in texts]))) if texts else {}
    out = [r["prompt_token_ids"] if "prompt_token_ids" in r else encoded[i] for i, r in enumerate(rows)]
    for i, ids in enumerate(out):
        if max(ids) >= vocab_size:
            raise ValueError(f"row {i + 1} of {args.input} holds token id {max(ids)}, past the model's vocabulary "
                             f"of {vocab_size}")
    return out


def run(argv: list[str]) -> Path:
    from rlcu.contracts import GenerationInterrupted, eos_token_ids
    from rlcu.devices import resolve_device
    from rlcu.models import load_model
    from rlcu.paths import check_writable_file
    from rlcu.rollout import SamplingParams, resolve_rollout, turns

    args = parser().parse_args(argv)
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    check_writable_file(args.output, "--output")  # before the model loads and generates, not after
    device = resolve_device(args.device)
    dtype = ("bfloat16" if device == "cuda" else "float32") if args.dtype == "auto" else args.dtype
    rows = read_prompts(args.input)
    model, tok = load_model(args.model, dtype=dtype)
    model.to(device).eval()
    backend = resolve_rollout(args.rollout)
    backend.setup(model, tok)
    prompt_ids = prompt_token_ids(rows, tok, model.config.vocab_size, args)
    context = model.config.max_position_embeddings
    for i, ids in enumerate(prompt_ids):  # before any work: past the context a model computes garbage
        if len(ids) + args.max_tokens > context:
            raise ValueError(f"prompt {i} of {args.input} has {len(ids)} tokens: with --max_tokens {args.max_tokens} "
                             f"it passes the model's context of {context}; shorten it or lower --max_tokens")
    stops = eos_token_ids(model.config, tok)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, stop_token_ids=stops, seed=args.seed,
                              repetition_penalty=args.repetition_penalty)
    start = time.perf_counter()
    requests = [ids for ids in prompt_ids for _ in range(args.n)]
    progress = Progress(len(requests))
    with StopOnSignal() as stop:
        try:
            out = turns.generate(backend, requests, sampling, on_finished=progress.one, should_stop=stop.asked)
        except GenerationInterrupted:
            print(f"rlcu generate: stopped by {stop.signal.name}; nothing written", file=sys.stderr)
            sys.exit(128 + stop.signal)
    seconds = time.perf_counter() - start
    with open(args.output, "w") as f:
        for i, (ids, lps, reason) in enumerate(zip(out.completion_ids, out.logprobs, out.finish_reasons)):
            row = rows[i // args.n]
            record = {k: v for k, v in row.items()}
            text = tok.decode(ids, skip_special_tokens=True) if tok is not None else None
            record.update(index=i // args.n, sample=i % args.n, completion=text,
                          completion_ids=ids, logprobs=lps, finish_reason=reason, prompt_ids=out.prompt_ids[i])
            f.write(json.dumps(record) + "\n")
    tokens = sum(len(c) for c in out.completion_ids)
    print(f"rlcu generate: {len(out)} completions, {tokens} tokens in {seconds:.1f} s "
          f"({tokens / max(seconds, 1e-9):.0f} tok/s) -> {args.output}", file=sys.stderr)
    return args.output
