"""Tiny random models of each family, saved as HF folders by transformers itself, plus a word-level
tokenizer, so tests compare rlcu with the real reference implementation without any download."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from rlcu.data.tokenizers import word_tokenizer

FAMILIES = {
    "llama": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True)),
    "llama-untied-bias": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=False, attention_bias=True)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=False)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(tie_word_embeddings=True)),
}
# the families beyond Llama (tests/models/test_families.py); windows of 5 keys so that 13-token rows cross them
DENSE_FAMILIES = {
    "mistral": dict(cls="MistralConfig", extra=dict(sliding_window=5)),
    "mistral-full": dict(cls="MistralConfig", extra=dict(sliding_window=None, tie_word_embeddings=True)),
    "granite": dict(cls="GraniteConfig", extra=dict(embedding_multiplier=3.0, residual_multiplier=0.4,
                                                    attention_multiplier=0.2, logits_scaling=2.5)),
    "olmo2": dict(cls="Olmo2Config", extra=dict()),
    "olmo3": dict(cls="Olmo3Config", extra=dict(sliding_window=5,
                                                layer_types=["sliding_attention", "full_attention"])),
    "phi3": dict(cls="Phi3Config", extra=dict(pad_token_id=62, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "smollm3": dict(cls="SmolLM3Config", extra=dict(no_rope_layers=[1, 0])),
    "seed_oss": dict(cls="SeedOssConfig", extra=dict(attention_bias=True, attention_out_bias=False)),
    "gemma2": dict(cls="Gemma2Config", extra=dict(sliding_window=5, final_logit_softcapping=3.0,
                                                  attn_logit_softcapping=5.0, query_pre_attn_scalar=16)),
    "gemma3_text": dict(cls="Gemma3TextConfig", extra=dict(
        sliding_window=5, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=12,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0)})),
}
FAMILIES.update(DENSE_FAMILIES)
# mixture-of-experts families (tests/models/test_moe.py): 8 experts, 3 a token (an odd split), layer 1 dense
MOE_FAMILIES = {
    "qwen3_moe": dict(cls="Qwen3MoeConfig", extra=dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                                                       norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe-unnormalised": dict(cls="Qwen3MoeConfig", extra=dict(num_experts=8, num_experts_per_tok=3,
                                                                    moe_intermediate_size=24, norm_topk_prob=False,
                                                                    decoder_sparse_step=1)),
    "olmoe": dict(cls="OlmoeConfig", extra=dict(num_experts=8, num_experts_per_tok=3, intermediate_size=24,
                                                head_dim=None, norm_topk_prob=False)),
    "granitemoe": dict(cls="GraniteMoeConfig", extra=dict(
        num_local_experts=8, num_experts_per_tok=3, intermediate_size=24, embedding_multiplier=3.0,
        residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5)),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", extra=dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                                                       shared_expert_intermediate_size=20, mlp_only_layers=[1])),
}
# gpt-oss: sinks, biases, alternating windows, YaRN; a SwiGLU limit that clamps at these weights' scale
MOE_FAMILIES["gpt_oss"] = dict(cls="GptOssConfig", extra=dict(num_local_experts=8, num_experts_per_tok=3,
                                                              intermediate_size=24, sliding_window=5,
                                                              swiglu_limit=0.15, rope_parameters=dict(
                                                                  rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                                                  beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                                  original_max_position_embeddings=32)))
FAMILIES.update(MOE_FAMILIES)
# linear-attention hybrids (Gated DeltaNet layers beside full attention): odd head sizes, a GVA group of 2
HYBRID_FAMILIES = {
    "qwen3_5_text": dict(cls="Qwen3_5TextConfig", extra=dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, tie_word_embeddings=True)),
    "qwen3_5_moe_text": dict(cls="Qwen3_5MoeTextConfig", extra=dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=20)),
    "qwen3_next": dict(cls="Qwen3NextConfig", extra=dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=20, mlp_only_layers=[2])),
}
FAMILIES.update(HYBRID_FAMILIES)
# architectures with no native path: the transformers fallback (tests/models/test_hf_fallback.py)
FALLBACK_FAMILIES = {
    "gpt_neox": dict(cls="GPTNeoXConfig", extra=dict(tie_word_embeddings=False)),
    # a mixture of experts with a sliding window (5 keys) in transformers' own modules
    "mixtral": dict(cls="MixtralConfig", extra=dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                                                    tie_word_embeddings=False)),
    "falcon": dict(cls="FalconConfig", extra=dict(head_dim=None, new_decoder_architecture=True, num_kv_heads=2,
                                                  tie_word_embeddings=False)),
}
FAMILIES.update(FALLBACK_FAMILIES)


def tiny_hf_folder(path: Path, family: str = "llama", vocab_size: int = 64, hidden: int = 48, layers: int = 2,
                   heads: int = 6, kv_heads: int = 2, head_dim: int | None = 16, seed: int = 0,
                   chat_template: str | None = None, **overrides) -> Path:
    """A transformers model with random weights (GQA group 3 by default), saved as an HF folder."""
    import transformers

    spec = FAMILIES[family]
    cfg_cls = getattr(transformers, spec["cls"])
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1024,
              rms_norm_eps=1e-6, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 2, bos_token_id=None)
    kw.update(spec["extra"])
    kw.update(overrides)
    if kw["head_dim"] is None:  # the config class's own default (OLMoE's reads a head_dim attribute even when None)
        del kw["head_dim"]
    for key in ("layer_types", "no_rope_layers"):  # per-layer patterns repeat to the model's depth
        if key in kw:
            kw[key] = [kw[key][i % len(kw[key])] for i in range(kw["num_hidden_layers"])]
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: perturb so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    tok = word_tokenizer(vocab_size)
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    return Path(path)


def reference_generate(model, prompts, sampling, tokenizer=None):
    """The oracle: the reference rollout backend on `model`."""

    from rlcu.rollout.reference import ReferenceRollout

    backend = ReferenceRollout()
    backend.setup(model, tokenizer)
    return backend.generate(prompts, sampling)


def toy_rows(n: int, seed: int = 0, chat: bool = False) -> list[dict]:
    """Prompt 'tD' (D in 0..7); the verifiable answer is token t(D+8), repeated."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = rng.randrange(8)
        prompt = [{"role": "user", "content": f"t{d}"}] if chat else f"t{d}"
        rows.append({"prompt": prompt, "target": d + 8})
    return rows


def match_target(prompts, completions, completion_ids, target, **kwargs):
    """A TRL-style reward: the fraction of 4 completion tokens equal to the row's target token."""
    return [sum(t == tg for t in ids) / 4 for ids, tg in zip(completion_ids, target)]


def varied_reward(prompts, completions, completion_ids, **kwargs):
    """A reward that differs between almost any two completions (their token ids' sum mod 7): every group has
    advantages, so a test of a training step's mechanics gets gradients on a model too random to earn a real
    reward."""
    return [float(sum(ids) % 7) for ids in completion_ids]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def fit(module, rows, steps: int, log_dir, batch_size: int = 4, max_epochs: int | None = None,
        accelerator: str = "cpu", precision: str = "32-true"):
    """Train with Lightning on CPU and return the logged metrics rows (CSV logger, as users see them)."""
    import csv
    import logging

    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from rlcu.data.prompts import collate_rows

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    trainer = L.Trainer(max_steps=steps, max_epochs=max_epochs, accelerator=accelerator, devices=1, precision=precision,
                        logger=L.loggers.CSVLogger(log_dir), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, DataLoader(rows, batch_size=batch_size, collate_fn=collate_rows))
    assert trainer.strategy.root_device.type == ("cuda" if accelerator == "gpu" else "cpu")
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]


def grpo_batch(prompt_lengths: list[int], completion_lengths: list[int], seed: int = 0, vocab: int = 62):
    """Random ids laid out as the GRPO module lays a batch out: prompts left-padded, completions
    right-padded. Returns (ids, attention mask, number of completion columns)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p, c = max(prompt_lengths), max(completion_lengths)
    ids = torch.randint(0, vocab, (len(prompt_lengths), p + c), generator=g)
    mask = torch.zeros_like(ids)
    for i, (n, m) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[i, p - n:p + m] = 1
    return ids, mask, c


# ---- kernel tests: the device they run on (the interpreter on CPU machines) and shared references
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's bf16 arithmetic is wrong: bf16 only on the GPU
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if KERNEL_DEVICE == "cuda" else [])


def paged_cache(context_lens, hkv, d, block_size, dtype, seed=0, device=KERNEL_DEVICE):
    """A shuffled block pool holding random K/V for each sequence, and its block table."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    total = sum(need) + 3  # spare blocks the tables never name
    order = torch.randperm(total, generator=g)
    k = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(context_lens), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = order[used:used + n]
        used += n
    return k.to(device), v.to(device), table.to(device)


def float64_attention(q, k, v, table, ctx, q_positions, window=None, sinks=None, softcap=None):
    """Straight from the definition, one query at a time, in float64 (`window`: the last keys a query sees;
    `sinks` [Hq]: a logit per head in the softmax whose share is dropped; `softcap`: scores as cap tanh(s / cap))."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    for i, (s, pos) in enumerate(q_positions):
        keys = k[table[s].long()].flatten(0, 1)[:ctx[s]].double().cpu()
        vals = v[table[s].long()].flatten(0, 1)[:ctx[s]].double().cpu()
        for h in range(q.shape[1]):
            lo = 0 if window is None else max(0, pos + 1 - window)
            scores = keys[lo:pos + 1, h // group] @ q[i, h].double().cpu() / math.sqrt(q.shape[-1])
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].double().cpu()[None]])
            out[i, h] = torch.softmax(scores, 0)[:pos + 1 - lo] @ vals[lo:pos + 1, h // group]
    return out


def grads(fn, inputs, upstream):
    """Gradients of sum(out_i * upstream_i) with respect to each input."""
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, upstream[:len(outs)])
    return [x.grad for x in inputs]


# (atol, rtol) per dtype for the elementwise kernels: both sides round at the same points, only summation
# order differs
POINTWISE_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def assert_close(got, exact, dtype, scale=1.0, tolerance=POINTWISE_TOLERANCE):
    """`got` against a float64 `exact` within `tolerance[dtype]` times `scale`."""
    atol, rtol = tolerance[dtype]
    assert torch.allclose(got.double().cpu(), exact.cpu(), atol=scale * atol, rtol=scale * rtol), \
        (got.double().cpu() - exact.cpu()).abs().max()


# ---- shared by several test modules (tests import helpers, never each other)
EOS = 63


# a single token, lengths across block boundaries (block 16), shared prefixes, and repeated prompts (forks)
PROMPTS = [[5], list(range(1, 17)), list(range(1, 18)), list(range(1, 18)) + [40, 41], [7] * 33, [7] * 33, [7] * 33,
           [9, 8, 7]]


TOY_STEPS = 120  # lr 5e-3: every variant rises on seeds 0-2 with both backends (measured, not tuned to one seed)
TOY_WINDOW = 10


def toy_model(path: Path, family: str = "llama"):
    """(model, tokenizer) of the toy task: a tiny llama (or `family`) over 32 tokens, its tokenizer with
    CHAT_TEMPLATE."""
    from rlcu.models import load_model

    return load_model(tiny_hf_folder(path, family, vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                                     chat_template=CHAT_TEMPLATE))


def run_toy(tmp_path, seed=0, accelerator="cpu", **options):
    """GRPO on the toy task (reward: match the target token) for TOY_STEPS steps; the logged metrics."""
    from rlcu.grpo.module import GRPOModule

    model, tok = toy_model(tmp_path / "m")
    options = dict(dict(num_generations=8, max_completion_length=4, learning_rate=5e-3, micro_batch_size=16,
                        seed=seed, lr_scheduler="constant"), **options)  # the rate the toy task was tuned at
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], **options)
    return fit(module, toy_rows(4 * TOY_STEPS, seed=seed), TOY_STEPS, tmp_path / "logs", accelerator=accelerator)


def assert_rises(rewards, label):
    first, last = sum(rewards[:TOY_WINDOW]) / TOY_WINDOW, sum(rewards[-TOY_WINDOW:]) / TOY_WINDOW
    assert first < 0.1, f"{label}: the task should start near chance, got {first:.3f}"
    assert last > first + 0.2, f"{label}: mean reward went from {first:.3f} to only {last:.3f}"


G = 4


class FixedRollout:
    """Sample j of a group: a function of the prompt and j alone, 1 to 4 tokens long."""

    def setup(self, policy, tokenizer):
        self.vocab = policy.config.vocab_size

    def generate(self, prompt_ids, sampling):
        from rlcu.contracts import RolloutBatch

        completions = []
        for i, p in enumerate(prompt_ids):
            j = i % G  # requests come as groups of G copies of a prompt
            n = 1 + (sum(p) + j) % 4
            completions.append([(sum(p) * 3 + j * 7 + t) % (self.vocab - 2) for t in range(n)])
        unknown = float("nan")  # a backend that cannot score its samples: the sampler correction leaves them be
        return RolloutBatch([list(p) for p in prompt_ids], completions, [[unknown] * len(c) for c in completions],
                            ["length"] * len(completions))

    def release(self):
        pass

    def on_weights_updated(self):
        pass


def token_value(prompts, completions, completion_ids, **kwargs):
    return [sum(ids) / (8 * len(ids)) for ids in completion_ids]


def first_token_value(prompts, completions, completion_ids, **kwargs):
    """Higher token ids score higher: training moves the greedy completions for sure."""
    return [ids[0] / 32 if ids else 0.0 for ids in completion_ids]


def hangs_forever(completions, **kwargs):
    """A reward that never returns (it first touches $RLCU_TEST_MARKER so a test knows it was reached)."""
    import os
    import time

    Path(os.environ["RLCU_TEST_MARKER"]).touch()
    while True:
        time.sleep(0.01)


def logprob_gaps(model, out, temperature: float = 1.0) -> torch.Tensor:
    """|engine - training forward| logprob of every sampled token of the rollout `out`, on the model's device."""
    from rlcu.grpo.logprobs import completion_logprobs

    device = next(model.parameters()).device
    gaps = []
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        ids = torch.tensor([p + c], device=device)
        ref, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(c), temperature)
        gaps.append((ref[0].float().cpu() - torch.tensor(lp)).abs())
    return torch.cat(gaps)
