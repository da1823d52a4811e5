"""Plain PyTorch sampling on the live policy: a left-padded batch decoded in lockstep over a dense KV
cache. Simple and exact, it runs anywhere and is the oracle the native engine is tested against."""
from __future__ import annotations

from collections.abc import Callable

import torch

from rlcu.contracts import GenerationInterrupted, StopStrings
from rlcu.kernels.sampling import penalize_repeats, sample
from rlcu.rollout.base import Capabilities, RolloutBatch, SamplingParams


class ReferenceRollout:
    # episodes run turn by turn (`rollout/turns.py`), each turn prefilling its whole history; LoRA adapters
    # run as part of the live model's forward
    capabilities = Capabilities(lora=True, interruptible=True)

    def __init__(self, max_batch_size: int = 64):
        self.max_batch_size = max_batch_size
        self.model = self.tokenizer = None

    def setup(self, policy, tokenizer=None) -> None:
        self.model, self.tokenizer = policy, tokenizer

    def release(self) -> None:
        pass  # the cache lives only inside generate()

    def on_weights_updated(self) -> None:
        pass  # the model is the module's own: nothing to sync

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 should_stop: Callable[[], bool] | None = None) -> RolloutBatch:
        if self.model is None:
            raise RuntimeError("ReferenceRollout.generate() called before setup(policy, tokenizer)")
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(2**62, ()).item()))
        out = RolloutBatch([], [], [], [])
        for start in range(0, len(prompt_token_ids), self.max_batch_size):
            chunk = prompt_token_ids[start:start + self.max_batch_size]
            ids, lps, reasons = self._generate(chunk, sampling, gen, device, should_stop)
            out.prompt_ids += [list(p) for p in chunk]
            out.completion_ids += ids
            out.logprobs += lps
            out.finish_reasons += reasons
        return out

    def _generate(self, prompts, sp: SamplingParams, gen, device, should_stop=None):
        b, p = len(prompts), max(len(x) for x in prompts)
        ids = torch.zeros(b, p, dtype=torch.long, device=device)
        valid = torch.zeros(b, p, dtype=torch.bool, device=device)
        for i, x in enumerate(prompts):
            ids[i, p - len(x):] = torch.tensor(x, device=device)
            valid[i, p - len(x):] = True
        decoder = self.model.incremental(b, p + sp.max_tokens)  # the model's own KV cache (native or transformers')
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        logits = decoder.prefill(ids, valid, pos)
        stop = torch.tensor(sorted(set(sp.stop_token_ids)) or [-1], device=device)
        stop_strings = StopStrings(self.tokenizer, sp.stop)
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        tokens, logprobs, lengths = [], [], torch.zeros(b, dtype=torch.long, device=device)
        pos = pos[:, -1:]
        seen = [list(x) for x in prompts] if sp.repetition_penalty != 1.0 else None
        for step in range(sp.max_tokens):
            if should_stop is not None and step % 16 == 0 and should_stop():
                raise GenerationInterrupted(f"the run was asked to stop while the rollout was decoding (token {step})")
            if seen is not None:
                logits = penalize_repeats(logits, seen, sp.repetition_penalty)
            tok, lp = sample(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p, gen)
            tokens.append(tok)
            logprobs.append(lp)
            if seen is not None:
                for row, t in zip(seen, tok.tolist()):
                    row.append(t)
            lengths += (~finished).long()
            finished |= torch.isin(tok, stop)
            if stop_strings:
                tail = torch.stack(tokens[-stop_strings.window:], 1).tolist()  # all hit() ever decodes
                for i in (~finished).nonzero()[:, 0].tolist():
                    finished[i] = stop_strings.hit(tail[i])
            if bool(finished.all()) or step == sp.max_tokens - 1:
                break
            pos = pos + 1
            logits = decoder.step(tok, pos)
        toks = torch.stack(tokens, 1).tolist()
        lps = torch.stack(logprobs, 1).tolist()
        lengths, finished = lengths.tolist(), finished.tolist()
        return ([t[:n] for t, n in zip(toks, lengths)], [lp[:n] for lp, n in zip(lps, lengths)],
                ["stop" if f else "length" for f in finished])
