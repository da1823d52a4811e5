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
    def _chunk(base, seed, v0, end, inv_temp, Q: tl.constexpr):
        """Tokens v0 .. v0 + 4Q - 1 (v0 a multiple of 4Q) in four blocks of Q: each block's token ids, scaled logits
        (-inf from `end` on) and Gumbel noise. Token v0 + jQ + i takes the j-th of the four uniforms that Philox
        makes from counter v0 / 4 + i, for a row's seed: the one definition of the noise both kernels draw from,
        so that a draw depends on neither the kernel nor the split of the vocabulary. A Philox draw per token
        (ten rounds of integer multiplies) was most of the sampler's time; here one serves four."""
        i = tl.arange(0, Q)
        u0, u1, u2, u3 = tl.rand4x(seed, v0 // 4 + i)
        t0 = v0 + i
        t1 = t0 + Q
        t2 = t1 + Q
        t3 = t2 + Q
        return (t0, t1, t2, t3, _scaled(base, t0, end, inv_temp), _scaled(base, t1, end, inv_temp),
                _scaled(base, t2, end, inv_temp), _scaled(base, t3, end, inv_temp), _gumbel(u0), _gumbel(u1),
                _gumbel(u2), _gumbel(u3))

    @triton.jit
    def _scaled(base, t, end, inv_temp):
        return tl.load(base + t, mask=t < end, other=float("-inf")).to(tl.float32) * inv_temp

    @triton.jit
    def _gumbel(u):
        return -tl.log(-tl.log(tl.maximum(u, 1e-20)))

    @triton.jit
    def _keep_better(best, best_idx, score, t):
        """Per lane, the running Gumbel-max winner: a later token replaces it only when strictly better."""
        better = score > best
        return tl.where(better, score, best), tl.where(better, t, best_idx)

    @triton.jit
    def _winner(best, best_idx):
        """The lanes' best score and its token, the lowest id on a tie (as one scan in token order keeps the first)."""
        top = tl.max(best, 0)
        return top, tl.min(tl.where(best == top, best_idx, 2147483647), 0)

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
        Q: tl.constexpr = BLOCK_V // 4
        best = tl.full([Q], float("-inf"), tl.float32)
        best_idx = tl.zeros([Q], tl.int32)
        for v0 in range(0, V, BLOCK_V):  # Gumbel-max over the kept tokens
            t0, t1, t2, t3, x0, x1, x2, x3, g0, g1, g2, g3 = _chunk(base, seed, v0, V, inv_temp, Q)
            best, best_idx = _keep_better(best, best_idx, tl.where(x0 > floor, x0 + g0, float("-inf")), t0)
            best, best_idx = _keep_better(best, best_idx, tl.where(x1 > floor, x1 + g1, float("-inf")), t1)
            best, best_idx = _keep_better(best, best_idx, tl.where(x2 > floor, x2 + g2, float("-inf")), t2)
            best, best_idx = _keep_better(best, best_idx, tl.where(x3 > floor, x3 + g3, float("-inf")), t3)
        best, best_idx = _winner(best, best_idx)
        x_tok = tl.load(base + best_idx).to(tl.float32) * inv_temp
        tl.store(TOK + row, best_idx.to(tl.int64))
        tl.store(LP + row, x_tok - lse)


    @triton.jit
    def _split_kernel(L, stride_l, V, SEEDS, M, S, BEST, IDX, inv_temp, span, num_splits, BLOCK_V: tl.constexpr):
        """No filter: one program per (row, share of the vocabulary) finds its share's max, sum of exp and
        Gumbel-max winner; `_combine_kernel` merges the shares. The sum and the winner are kept per lane and
        reduced once at the end: a chunk's only reduction is its max."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        base = L + row * stride_l
        seed = tl.load(SEEDS + row)
        start = split * span
        end = tl.minimum(start + span, V)
        Q: tl.constexpr = BLOCK_V // 4
        m = float("-inf")
        total = tl.zeros([Q], tl.float32)
        best = tl.full([Q], float("-inf"), tl.float32)
        best_idx = tl.zeros([Q], tl.int32)
        for v0 in range(start, end, BLOCK_V):
            t0, t1, t2, t3, x0, x1, x2, x3, g0, g1, g2, g3 = _chunk(base, seed, v0, end, inv_temp, Q)
            m_new = tl.maximum(m, tl.max(tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3)), 0))
            total = (total * tl.exp(m - m_new) + tl.exp(x0 - m_new) + tl.exp(x1 - m_new) + tl.exp(x2 - m_new)
                     + tl.exp(x3 - m_new))
            m = m_new
            best, best_idx = _keep_better(best, best_idx, x0 + g0, t0)
            best, best_idx = _keep_better(best, best_idx, x1 + g1, t1)
            best, best_idx = _keep_better(best, best_idx, x2 + g2, t2)
            best, best_idx = _keep_better(best, best_idx, x3 + g3, t3)
        best, best_idx = _winner(best, best_idx)
        out = row * num_splits + split
        tl.store(M + out, m)
        tl.store(S + out, tl.sum(total, 0))
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
    block_v = 1024 if v >= 1024 else max(16, triton.next_power_of_2(v))  # four blocks of 4+ (_chunk)
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


def penalize_repeats(logits: torch.Tensor, seen: list[list[int]], penalty: float) -> torch.Tensor:
    """Repetition penalty (vLLM's and transformers'): in row i, each token of `seen[i]` has its logit divided by
    `penalty` where positive and multiplied where negative. Returns fp32 logits (a new tensor)."""
    out = logits.float().clone()
    rows = torch.tensor([i for i, ids in enumerate(seen) for _ in ids], dtype=torch.long)
    cols = torch.tensor([t for ids in seen for t in ids], dtype=torch.long)
    if len(cols):
        rows, cols = rows.to(out.device, non_blocking=True), cols.to(out.device, non_blocking=True)
        x = out[rows, cols]
        out[rows, cols] = torch.where(x > 0, x / penalty, x * penalty)
    return out


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None, seeds=None):
    """`seeds` (int64 [B], on the logits' device) selects per-row randomness, and the Triton kernel
    where it runs."""
    if seeds is not None and temperature > 0 and use_triton(logits):
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    return sample_reference(logits, temperature, top_k, top_p, min_p, generator, seeds)
