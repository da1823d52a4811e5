"""Exact mode on the linear-attention hybrids, bisected by layer kind: the GPU exact test's model and prompts
(tests/gpu/test_exact_cuda.py: vocab 512, hidden 256, 3 layers, 96 sequences of up to 96 tokens) with the layer types
of Qwen3.5 and Qwen3-Next as they are, all linear attention or all full attention, in bf16 autocast over fp32 weights
and in bf16 weights. Prints, per variant, the sampled tokens whose engine logprob differs from the training
forward's ("off"), the largest difference, the first (row, position) pairs, and per row that differs the first
position off, how many follow, and the row's prompt and completion lengths.

A variant may name engine settings after a colon, to bisect the engine's features the same way:
`q35-all-linear:lookahead=0,cuda_graphs=0` (EngineConfig's fields; 0/1 for booleans). `ops=1` among them (CUDA
graphs off, so that every call is seen) bisects by operation: forward hooks on the row-local modules (linear
layers, norms, MLPs: each output row a function of its input row alone) record what each gave the engine, input
bits to output bits, and the training forward's rows are looked up there. A module whose same input gave another
output is batch-variant; when every module agrees, the gap is in what carries state (the convolution, the delta
rule, attention). Prints `DIAG-OPS` lines: per module, rows with the same output, another output, an input the
engine never saw.

    PYTHONPATH=. python3 benchmarks/exact_hybrid_layers.py [VARIANT[:FIELD=VALUE,...] ...]   (from the repository root)
"""
import sys
import tempfile
from collections import Counter, defaultdict

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


ROW_LOCAL = ("Linear", "FusedLinear", "RMSNorm", "GatedRMSNorm", "MLP")


class OpRecorder:
    """Forward hooks on the row-local modules: while `recording`, each output row's bits are kept under its input
    rows' bits, per module; afterwards each row is counted as "same", "other" (the same input gave other bits) or
    "unseen". Rows: the output's leading dimensions, each input taken as that many rows."""

    def __init__(self, model):
        self.recording, self.seen, self.counts = True, defaultdict(dict), defaultdict(Counter)
        self.order = []
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()
                        if type(m).__name__ in ROW_LOCAL]

    @staticmethod
    def _rows(t: torch.Tensor, r: int) -> list[bytes]:
        b = t.detach().contiguous().reshape(r, -1).view(torch.uint8).cpu().numpy()
        return [row.tobytes() for row in b]

    def _hook(self, name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if not torch.is_tensor(out) or out.dim() < 2:
                return
            r = out.numel() // out.shape[-1]
            ins = [self._rows(a, r) for a in args if torch.is_tensor(a) and a.dim() and a.numel() % r == 0]
            keys = [b"|".join(parts) for parts in zip(*ins)]
            if name not in self.order:
                self.order.append(name)
            seen = self.seen[name]
            for key, value in zip(keys, self._rows(out, r)):
                if self.recording:
                    seen[key] = value
                else:
                    self.counts[name]["unseen" if key not in seen else "same" if seen[key] == value else "other"] += 1
        return hook

    def report(self, label: str) -> None:
        for name in self.order:  # in forward order: the first module with rows unseen is where the gap begins
            c = self.counts[name]
            if c["other"] or c["unseen"] or name == self.order[0]:
                print(f"DIAG-OPS {label}: {name} same {c['same']} other {c['other']} unseen {c['unseen']}",
                      flush=True)
        print(f"DIAG-OPS {label}: modules with another output: "
              f"{[n for n in self.order if self.counts[n]['other']] or 'none'}", flush=True)
        for h in self.handles:
            h.remove()


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
        ops = settings.pop("ops", False)
        if ops:
            settings["cuda_graphs"] = False
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
                    recorder = OpRecorder(model) if ops else None
                    out = engine.generate(rows, sp)
                    ids, mask, sampler, real = padded_batch(out)
                    if recorder:
                        recorder.recording = False
                    tr = trainer_logprobs(model, ids.cuda(), mask.cuda(), real.shape[1], 7, 1.0).float().cpu()
                gap = (tr - sampler).abs() * real
                bad = (gap > 0).nonzero().tolist()
                print(f"DIAG {arg} {prec}: tokens {int(real.sum())} off {len(bad)} max {gap.max().item():.3g} "
                      f"first {bad[:4]} stats {engine.stats}", flush=True)
                if bad:
                    print(f"DIAG {arg} {prec}: {rows_off(gap, real, out)}", flush=True)
                if recorder:
                    recorder.report(f"{arg} {prec}")
            except Exception as e:
                print(f"DIAG {arg} {prec}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
