"""Exact mode on the linear-attention hybrids, bisected by layer kind: the GPU exact test's model and prompts
(tests/gpu/test_exact_cuda.py: vocab 512, hidden 256, 3 layers, 96 sequences of up to 96 tokens) with the layer types
of Qwen3.5 and Qwen3-Next as they are, all linear attention or all full attention, in bf16 autocast over fp32 weights
and in bf16 weights. Prints, per variant, the sampled tokens whose engine logprob differs from the training
forward's ("off"), the largest difference, the first (row, position) pairs, and per row that differs the first
position off, how many follow, and the row's prompt and completion lengths.

A variant may name engine settings after a colon, to bisect the engine's features the same way:
`q35-all-linear:lookahead=0,cuda_graphs=0` (EngineConfig's fields; 0/1 for booleans).

    PYTHONPATH=. python3 benchmarks/exact_hybrid_layers.py [VARIANT[:FIELD=VALUE,...] ...]   (from the repository root)
"""
import sys
import tempfile

import torch

from rlcu.contracts import Numerics
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.engine.test_exact_logprobs import padded_batch, trainer_logprobs
from tests.gpu.test_exact_cuda import prompts
from tests.helpers import tiny_hf_folder

L, F = "linear_attention", "full_attention"
variants = {
    "q35-default": ("qwen3_5_text", {}),
    "q35-all-linear": ("qwen3_5_text", dict(layer_types=[L])),
    "q35-all-full": ("qwen3_5_text", dict(layer_types=[F])),
    "q35-full-rope1": ("qwen3_5_text", dict(layer_types=[F], partial_rotary_factor=1.0)),
    "qnext-default": ("qwen3_next", {}),
    "qnext-all-linear": ("qwen3_next", dict(layer_types=[L])),
}


def engine_settings(spec: str) -> dict:
    """`lookahead=0,cuda_graphs=0` -> {"lookahead": False, "cuda_graphs": False} (ints where not 0/1)."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        out[key] = bool(int(value)) if value in ("0", "1") else int(value)
    return out


def rows_off(gap, real, out) -> str:
    """Per row with a token off: row, first position off, tokens off, prompt and completion lengths."""
    parts = []
    for r in sorted({int(i) for i in (gap > 0).nonzero()[:, 0]}):
        where = (gap[r] > 0).nonzero()[:, 0]
        parts.append(f"row {r} from {int(where[0])} ({len(where)} off) prompt {len(out.prompt_ids[r])} "
                     f"completion {int(real[r].sum())}")
    return "; ".join(parts)


def main():
    for arg in sys.argv[1:] or variants:
        name, _, spec = arg.partition(":")
        family, over = variants[name]
        settings = engine_settings(spec)
        for prec in ("bf16-autocast", "bf16-weights"):
            try:
                with tempfile.TemporaryDirectory() as d:
                    model, _ = load_model(tiny_hf_folder(d, family, vocab_size=512, hidden=256, layers=3, heads=4,
                                                         kv_heads=2, head_dim=64, **over),
                                          dtype="bfloat16" if prec == "bf16-weights" else "float32")
                model.cuda()
                rows = [p for p in prompts(24, 512) for _ in range(4)]
                sp = SamplingParams(max_tokens=96, temperature=1.0, top_p=0.95, stop_token_ids=list(range(10)), seed=1)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "bf16-autocast"):
                    engine = LLMEngine(model, EngineConfig(**{**dict(max_num_batched_tokens=300, max_num_seqs=64,
                                                                     numerics=Numerics.EXACT), **settings}))
                    out = engine.generate(rows, sp)
                    ids, mask, sampler, real = padded_batch(out)
                    tr = trainer_logprobs(model, ids.cuda(), mask.cuda(), real.shape[1], 7, 1.0).float().cpu()
                gap = (tr - sampler).abs() * real
                bad = (gap > 0).nonzero().tolist()
                print(f"DIAG {arg} {prec}: tokens {int(real.sum())} off {len(bad)} max {gap.max().item():.3g} "
                      f"first {bad[:4]} stats {engine.stats}", flush=True)
                if bad:
                    print(f"DIAG {arg} {prec}: {rows_off(gap, real, out)}", flush=True)
            except Exception as e:
                print(f"DIAG {arg} {prec}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
