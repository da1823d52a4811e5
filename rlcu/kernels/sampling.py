"""Token sampling with temperature, top-k, top-p and min-p, returning each sampled token's logprob.

The one sampler of rlcu, used by both rollout backends. The returned logprob is log softmax(logits /
temperature) at the token, over the full vocabulary: exactly what the GRPO trainer recomputes, so the
two can be compared and the engine's logprobs can stand in for the "old" policy. Filters follow
transformers' order: temperature, top-k, top-p, min-p.

Randomness comes from a generator, or from one seed per row (`seeds`): then each row's draw depends
on its seed alone, so a request's completion does not change with the batch it happens to share.

Triton (per-row seeds, temperature > 0): without filters, each row's vocabulary is shared among
several programs whose partial maxima, sums and Gumbel-max winners a second kernel merges (a GRPO
rollout's usual case, kept short so that few rows still fill the GPU). With filters, one program per
row streams the vocabulary in chunks, never sorting. Top-k and top-p become thresholds on the scaled logits,
found by bisection (a kept token is
one above the threshold; min-p's threshold is max + log(min_p)), and the draw is a Gumbel-max over the
kept tokens with Philox noise."""
from __future__ import annotations

import math

import torch

from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton

BISECTION_STEPS = 48  # halvings of the logit range: below float32 spacing, so thresholds land on tokens


def sample_reference(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0, generator: torch.Generator | None = None,
                     seeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, logprobs [B] float32). temperature 0 is greedy."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / temperature
    logprobs = torch.log_softmax(scaled, -1)
    probs = torch.softmax(filter_logits(scaled, top_k, top_p, min_p), -1)
    # Gumbel-max in its exponential form: argmax p / E with E ~ Exp(1) draws from p, and takes a generator.
    if seeds is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    else:
        noise = torch.stack([torch.empty(probs.shape[1]).exponential_(generator=torch.Generator().manual_seed(int(s)))
                             for s in seeds.tolist()]).to(probs.device)
    tokens = (probs / noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def filter_logits(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Temperature-scaled logits with the tokens that top-k, top-p and min-p drop set to -inf."""
    filtered = scaled
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p; the most likely token always stays
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(filtered, -1)
        filtered = filtered.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return filtered


if HAS_TRITON:
    @triton.jit
    def _mass_above(base, V, t, inv_temp, m, floor, BLOCK_V: tl.constexpr, COUNT: tl.constexpr):
        """Tokens (COUNT) or unnormalised probability mass above t, among tokens above `floor`."""
        total = 0.0
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_temp
            above = (x > t) & (x > floor)
            if COUNT:
                total += tl.sum(above.to(tl.float32))
            else:
                total += tl.sum(tl.where(above, tl.exp(x - m), 0.0))
        return total

    @triton.jit
    def _gumbel(seed, idx):
        """Gumbel noise of token `idx` for a row's seed: the one definition both sampling kernels draw from."""
        return -tl.log(-tl.log(tl.maximum(tl.rand(seed, idx), 1e-20)))

    @triton.jit
    def _sample_kernel(L, stride_l, V, SEEDS, TOK, LP, inv_temp, top_k, top_p, log_min_p,
                       BLOCK_V: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr, STEPS: tl.constexpr):
        row = tl.program_id(0)
        base = L + row * stride_l
        m = float("-inf")
        lo = float("inf")
        total = 0.0
        for v0 in range(0, V, BLOCK_V):  # max, min and sum of exp of the scaled logits
            idx = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(x, 0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new))
            lo = tl.minimum(lo, tl.min(tl.where(idx < V, x, float("inf")), 0))
            m = m_new
        lse = m + tl.log(total)
        floor = lo - 1.0  # below every token: keeps all
        if TOP_K:  # the smallest t with fewer than k tokens above it is the k-th largest logit
            a, b = lo - 1.0, m
            for _ in range(STEPS):
                mid = (a + b) * 0.5
                few = _mass_above(base, V, mid, inv_temp, m, floor, BLOCK_V, True) < top_k
                a = tl.where(few, a, mid)
                b = tl.where(few, mid, b)
            floor = a
        if TOP_P:  # keep a token while the mass strictly above it is below top_p (of the top-k mass)
            kept_mass = _mass_above(base, V, floor, inv_temp, m, floor, BLOCK_V, False)
            a, b = floor, m
            for _ in range(STEPS):
                mid = (a + b) * 0.5
                small = _mass_above(base, V, mid, inv_temp, m, floor, BLOCK_V, False) < top_p * kept_mass
                a = tl.where(small, a, mid)
                b = tl.where(small, mid, b)
            floor = a
        floor = tl.maximum(floor, m + log_min_p - 1e-6 * tl.abs(m))  # min-p (a hair below, so the max stays)
        seed = tl.load(SEEDS + row)
        best = float("-inf")
        best_idx = 0
        for v0 in range(0, V, BLOCK_V):  # Gumbel-max over the kept tokens
            idx = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_temp
            g = _gumbel(seed, idx)
            score = tl.where((x > floor) & (idx < V), x + g, float("-inf"))
            chunk_best = tl.max(score, 0)
            chunk_idx = v0 + tl.argmax(score, 0)
            better = chunk_best > best
            best_idx = tl.where(better, chunk_idx, best_idx)
            best = tl.where(better, chunk_best, best)
        x_tok = tl.load(base + best_idx).to(tl.float32) * inv_temp
        tl.store(TOK + row, best_idx.to(tl.int64))
        tl.store(LP + row, x_tok - lse)


    @triton.jit
    def _split_kernel(L, stride_l, V, SEEDS, M, S, BEST, IDX, inv_temp, span, num_splits, BLOCK_V: tl.constexpr):
        """No filter: one program per (row, share of the vocabulary) finds its share's max, sum of exp and
        Gumbel-max winner; `_combine_kernel` merges the shares. The noise is the same function of (seed,
        token) as in `_sample_kernel`, so the draw does not depend on how the vocabulary is split."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        base = L + row * stride_l
        seed = tl.load(SEEDS + row)
        start = split * span
        end = tl.minimum(start + span, V)
        m = float("-inf")
        total = 0.0
        best = float("-inf")
        best_idx = 0
        for v0 in range(start, end, BLOCK_V):
            idx = v0 + tl.arange(0, BLOCK_V)
            inside = idx < end
            x = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(x, 0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new))
            m = m_new
            score = tl.where(inside, x + _gumbel(seed, idx), float("-inf"))
            chunk_best = tl.max(score, 0)
            better = chunk_best > best
            best_idx = tl.where(better, v0 + tl.argmax(score, 0), best_idx)
            best = tl.where(better, chunk_best, best)
        out = row * num_splits + split
        tl.store(M + out, m)
        tl.store(S + out, total)
        tl.store(BEST + out, best)
        tl.store(IDX + out, best_idx)

    @triton.jit
    def _combine_kernel(L, stride_l, M, S, BEST, IDX, TOK, LP, inv_temp, num_splits, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        k = tl.arange(0, SPLITS)
        valid = k < num_splits
        offs = row * num_splits + k
        m = tl.load(M + offs, mask=valid, other=float("-inf"))
        total = tl.load(S + offs, mask=valid, other=0.0)
        m_all = tl.max(m, 0)
        lse = m_all + tl.log(tl.sum(total * tl.exp(m - m_all), 0))
        best = tl.load(BEST + offs, mask=valid, other=float("-inf"))
        winner = tl.argmax(best, 0)  # the first share on a tie, as the single-program scan keeps the first
        token = tl.sum(tl.where(k == winner, tl.load(IDX + offs, mask=valid, other=0), 0), 0)
        x_tok = tl.load(L + row * stride_l + token).to(tl.float32) * inv_temp
        tl.store(TOK + row, token.to(tl.int64))
        tl.store(LP + row, x_tok - lse)


PROGRAMS = 2048  # unfiltered sampling: rows x vocabulary shares, enough to keep every SM of a large GPU busy


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds: torch.Tensor, steps: int = BISECTION_STEPS):
    b, v = logits.shape
    assert temperature > 0 and logits.stride(-1) == 1
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    top_k_on = 0 < top_k < v
    block_v = 1024 if v >= 1024 else triton.next_power_of_2(v)
    if not top_k_on and top_p >= 1.0 and min_p <= 0.0:
        chunks = -(-v // block_v)
        splits = max(1, min(chunks, PROGRAMS // max(1, b), 64))
        span = -(-chunks // splits) * block_v
        splits = -(-v // span)
        parts = torch.empty(4, b, splits, dtype=torch.float32, device=logits.device)
        idx = torch.empty(b, splits, dtype=torch.int32, device=logits.device)
        _split_kernel[(b, splits)](logits, logits.stride(0), v, seeds, parts[0], parts[1], parts[2], idx,
                                   1.0 / temperature, span, splits, BLOCK_V=block_v)
        _combine_kernel[(b,)](logits, logits.stride(0), parts[0], parts[1], parts[2], idx, tokens, logprobs,
                              1.0 / temperature, splits, SPLITS=max(2, triton.next_power_of_2(splits)))
        return tokens, logprobs
    _sample_kernel[(b,)](logits, logits.stride(0), v, seeds, tokens, logprobs, 1.0 / temperature,
                         float(top_k if top_k_on else v), float(top_p), math.log(min_p) if min_p > 0 else float("-inf"),
                         BLOCK_V=block_v, TOP_K=top_k_on, TOP_P=top_p < 1.0,
                         STEPS=steps)
    return tokens, logprobs


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None, seeds=None):
    """`seeds` (int64 [B], on the logits' device) selects per-row randomness, and the Triton kernel
    where it runs."""
    if seeds is not None and temperature > 0 and use_triton(logits):
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    return sample_reference(logits, temperature, top_k, top_p, min_p, generator, seeds)
