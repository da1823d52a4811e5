"""`rlcu bench`: rollout throughput and GRPO step time, on any supported model or on the standard
workload's model (a Qwen3-0.6B shape with random weights and a word-level tokenizer over its whole
vocabulary, as `../shared/peers` builds it for TRL). Completions run to full length, as the peers'
do, so that every run generates the same number of tokens.

    rlcu bench rollout --sequences 64 --new_tokens 512
    rlcu bench rollout --sequences 64 --new_tokens 512 --turns 4     (episodes: 4 turns of 128 tokens)
    rlcu bench rollout --sequences 64 --new_tokens 512 --turns 4 --http   (the same episodes in-process, then as
                                                                           programs calling the agent endpoint)
    rlcu bench step --prompts 8 --generations 8 --new_tokens 512

Each prints a table and, last, one JSON line."""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from rlcu.data.tokenizers import word_tokenizer
from rlcu.devices import resolve_device

QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
                 tie_word_embeddings=True, qk_norm=True)
STANDARD = "qwen3-0.6b-random"
# larger Qwen3 shapes with random weights, as ../shared/peers/common.py's SHAPE=1.7b|4b|8b (8B: untied embeddings)
SHAPES = {STANDARD: {},
          "qwen3-1.7b-random": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                    num_attention_heads=16, num_key_value_heads=8),
          "qwen3-4b-random": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                  num_attention_heads=32, num_key_value_heads=8),
          "qwen3-8b-random": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
          # Qwen3-32B's config.json: 64 GB in bf16, for tensor parallelism (--strategy tp)
          "qwen3-32b-random": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                   num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)}
# the public shapes of released checkpoints of other families, random weights, built by transformers' own config
# classes (RoPE bases and scaling left at the class's defaults: they change no step's work); gpt_neox has no
# native family and measures the transformers fallback
FAMILY_SHAPES = {
    "gemma3-1b-random": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                             num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                             sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
                             tie_word_embeddings=True),
    "gemma2-2b-random": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                             num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                             sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                             final_logit_softcapping=30.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "smollm3-3b-random": dict(model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                              num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                              max_position_embeddings=65536, tie_word_embeddings=True, no_rope_layer_interval=4),
    "mistral-7b-random": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              sliding_window=None, max_position_embeddings=32768),
    "phi4-mini-random": dict(model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                             num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                             partial_rotary_factor=0.75, max_position_embeddings=131072, tie_word_embeddings=True,
                             sliding_window=262144),
    "olmo2-1b-random": dict(model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                            max_position_embeddings=4096, tie_word_embeddings=False),
    # three sliding-window layers (4096 keys) to one global, transformers' Olmo3Config default layout
    "olmo3-7b-random": dict(model_type="olmo3", vocab_size=100278, hidden_size=4096, intermediate_size=11008,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, sliding_window=4096,
                            max_position_embeddings=65536, tie_word_embeddings=False),
    "granite-3.3-2b-random": dict(model_type="granite", vocab_size=49159, hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                                  embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                                  logits_scaling=8.0, max_position_embeddings=131072, tie_word_embeddings=True),
    "pythia-1b-random": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=8, max_position_embeddings=2048,
                             rotary_pct=0.25),
    # linear-attention hybrids: Qwen3.5-2B's language model as its config.json gives it (three Gated DeltaNet layers
    # to one full-attention layer); Qwen3.5-9B's and Qwen3-Next-80B-A3B's are transformers' config defaults
    "qwen3.5-2b-random": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2048, intermediate_size=6144,
                              num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                              linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                              max_position_embeddings=262144,
                              rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)),
    "qwen3.5-9b-random": dict(model_type="qwen3_5_text", vocab_size=248320),
    # mixture of experts at the released checkpoints' shapes (their config.json files)
    "qwen3-30b-a3b-random": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                 norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False),
    "gpt-oss-20b-random": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                               num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                               num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                               max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen3-next-80b-a3b-random": dict(model_type="qwen3_next", vocab_size=151936),
    # the largest dense shape trained in TRL's colocated-vLLM write-up: Qwen2.5-72B's config.json, 145 GB in bf16,
    # more than one H200 holds (--strategy tp --devices 8)
    "qwen2.5-72b-random": dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                               max_position_embeddings=32768, tie_word_embeddings=False),
}
PHASES = ("generate", "score", "train", "gather", "reshard", "idle")  # timing/* of a step; gather, reshard under fsdp2
SHARED_PREFIX = {"auto": None, "on": True, "off": False}  # --shared_prefix -> EngineConfig.shared_prefix


def random_model(device: str, dtype: torch.dtype, seed: int = 0, shape: str = STANDARD):
    """The standard workload's model (or a larger shape of it), initialised as transformers does (normal, std 0.02)."""
    from rlcu.models.config import ModelConfig

    fields = dict(QWEN3_06B, **SHAPES[shape])
    cfg = ModelConfig(**fields, eos_token_id=fields["vocab_size"] - 1, pad_token_id=fields["vocab_size"] - 2)
    torch.manual_seed(seed)
    return random_native(cfg, device, dtype, shape), word_tokenizer(cfg.vocab_size)


def random_native(cfg, device: str, dtype: torch.dtype, name: str = "this shape"):
    """rlcu's decoder for `cfg`, initialised as transformers does: normal, std 0.02; norms at their identity. Built
    in `dtype` (a 30B model in fp32 would not fit one GPU beside its cast)."""
    from rlcu.models.decoder import CausalLM
    from rlcu.models.loading import require_fits, weight_bytes
    from rlcu.models.random_init import init_weights

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # its size first: a model no one GPU holds is refused before any memory is taken
            require_fits(weight_bytes(CausalLM(cfg)), device, name)
        with torch.device(device):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    if device != "meta":  # on the meta device: weights drawn once a rank holds its share (tensor parallelism)
        init_weights(model)
    return model.to(dtype)


def family_config(name: str):
    """A FAMILY_SHAPES entry as transformers' own config object, with the word tokenizer's eos and pad ids."""
    from transformers import AutoConfig

    fields = dict(FAMILY_SHAPES[name])
    vocab = fields["vocab_size"]
    return AutoConfig.for_model(fields.pop("model_type"), **fields, eos_token_id=vocab - 1, pad_token_id=vocab - 2,
                                bos_token_id=None)


def random_family_model(name: str, device: str, dtype: torch.dtype, seed: int = 0):
    """A FAMILY_SHAPES model with random weights: rlcu's native decoder where the family has one (initialised as
    transformers does: normal, std 0.02; norms at their identity), else transformers' own module on the fallback."""
    from rlcu.models.config import ModelConfig
    from rlcu.models.spec import family

    hf = family_config(name)
    torch.manual_seed(seed)
    if family(hf.model_type) is None:
        from transformers import AutoModelForCausalLM

        from rlcu.models.hf import HFCausalLM

        with torch.device(device):
            model = HFCausalLM(AutoModelForCausalLM.from_config(hf, dtype=dtype))
        return model, word_tokenizer(hf.vocab_size)
    cfg = ModelConfig.from_hf(hf.to_dict())
    return random_native(cfg, device, dtype, name), word_tokenizer(cfg.vocab_size)


def build_model(name: str, device: str, dtype: str):
    from rlcu.models.loading import load_model, resolve_dtype

    if name in SHAPES:
        return random_model(device, resolve_dtype(dtype), shape=name)
    if name in FAMILY_SHAPES:
        return random_family_model(name, device, resolve_dtype(dtype))
    if name.endswith("-random") and not os.path.exists(name):  # a misspelt shape of the benches is not a hub id
        raise ValueError(f"--model {name}: no such random shape; rlcu bench builds "
                         f"{', '.join([*SHAPES, *FAMILY_SHAPES])}")
    model, tok = load_model(name, dtype=dtype)
    # the benchmarks sample token ids: a folder without a tokenizer gets one that covers the vocabulary
    return model.to(device), tok if tok is not None else word_tokenizer(model.config.vocab_size)


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT's target_parameters for MoE


def lora_config(rank: int, experts: bool = False) -> dict | None:
    if not rank:
        return None
    return {"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear",
            **({"target_parameters": EXPERT_PARAMETERS} if experts else {})}


def random_prompt_ids(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size - 2) for _ in range(length)] for _ in range(n)]


PROMPT_SLACK = 8  # a step's max_prompt_length past --prompt_len: room for the tokens a tokenizer adds (BOS)


def prompt_texts(tok, prompts: list[list[int]], limit: int) -> list[str]:
    """The step's prompts as text, which the module takes as TRL's trainer does. A real tokenizer can read random
    ids, decoded, back as more ids (byte pieces, a special token's name spelt out): such a text is cut by its
    excess until it tokenizes within `limit` ids, so that a step on any model's tokenizer starts."""
    from rlcu.data.prompts import encode_prompt

    texts = []
    for ids in prompts:
        text = tok.decode(ids)
        for _ in range(8):
            excess = len(encode_prompt(tok, text)) - limit  # as the module counts it
            if excess <= 0:
                break
            ids = tok(text, add_special_tokens=False)["input_ids"]
            text = tok.decode(ids[:max(1, len(ids) - excess)])
        else:
            raise ValueError(f"a random prompt does not come within {limit} tokens of this tokenizer; "
                             "pass a larger --prompt_len")
        texts.append(text)
    return texts


def parser() -> argparse.ArgumentParser:
    from rlcu.engine.llm_engine import EngineConfig
    from rlcu.engine.states import STATE_DTYPES

    p = argparse.ArgumentParser(prog="rlcu bench", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("rollout", "step"):
        s = sub.add_parser(name, allow_abbrev=False)
        s.add_argument("--model", default=STANDARD,
                       help=f"{', '.join([*SHAPES, *FAMILY_SHAPES])} (random weights) or any model rlcu loads")
        s.add_argument("--prompt_len", type=int, default=128)
        s.add_argument("--new_tokens", type=int, default=512)
        s.add_argument("--dtype", default="bfloat16")
        s.add_argument("--device", default="auto", help="auto (cuda where torch sees a GPU, else cpu), cpu, cuda")
        s.add_argument("--no_cuda_graphs", action="store_true")
        s.add_argument("--no_lookahead", dest="lookahead", action="store_false",
                       help="wait for each decode step's tokens on the host before launching the next")
        s.add_argument("--block_size", type=int, default=16)
        s.add_argument("--shared_prefix", choices=("auto", "on", "off"), default="auto",
                       help="decode attention reads the prompt blocks a group of samples shares once for all of them: "
                            "auto (the engine's default) at decode steps of 256 sequences or more, on at any size")
        s.add_argument("--kv_cache_dtype", choices=("auto", "fp8"), default="auto",
                       help="fp8: keys and values in e4m3 (half the bytes a decode step reads; a logprob cost)")
        s.add_argument("--mamba_ssm_cache_dtype", choices=tuple(STATE_DTYPES),
                       default=EngineConfig.mamba_ssm_cache_dtype,
                       help="a hybrid's delta-rule states in the pool (vLLM's name): bfloat16 halves a decode step's "
                            "largest traffic, each new state rounded once")
        s.add_argument("--exact_logprobs", action="store_true",
                       help="batch-invariant kernels: the engine's logprobs equal the trainer's to the bit")
        s.add_argument("--profile", metavar="DIR",
                       help=f"profile one extra {name} (not in the timings): GPU time and kernels, DIR/trace.json")
    r = sub.choices["rollout"]
    r.add_argument("--sequences", type=int, default=64)
    r.add_argument("--generations", type=int, default=1, help="samples per prompt (they share its KV blocks)")
    r.add_argument("--repeats", type=int, default=2, help="timed runs after one warm-up run")
    r.add_argument("--turns", type=int, default=1,
                   help="multi-turn episodes: new_tokens sampled in this many turns, with --turn_tokens tokens "
                        "appended after each turn but the last (an instant environment: no tool time)")
    r.add_argument("--turn_tokens", type=int, default=32, help="tokens the environment appends between turns")
    r.add_argument("--http", action="store_true",
                   help="with --turns: each timed run twice, in-process, then as agent programs that make each turn an "
                        "HTTP /v1/completions call to the agent endpoint (the same token counts)")
    from rlcu.grpo.options import FIELDS

    r.add_argument("--agent_processes", type=int, default=FIELDS["agent_processes"][1].default,
                   help="with --http: GRPOModule's agent_processes, the same values and default (under rlcu bench the "
                        "default gives worker processes)")
    s = sub.choices["step"]
    s.add_argument("--prompts", type=int, default=8)
    s.add_argument("--generations", type=int, default=8)
    s.add_argument("--steps", type=int, default=4, help="GRPO steps; the first is reported apart as warm-up")
    s.add_argument("--profile_steps", type=int, default=1,
                   help="with --profile: this many extra steps under one profile (a pattern of slow steps shows)")
    # a micro-batch of 64 x 640 tokens keeps the H200 busy (smaller ones leave it waiting on the host's
    # kernel launches) and stays under the peer's memory at both standard workloads
    s.add_argument("--micro_batch_size", type=int, default=64)
    # the defaults are the peer's (TRL's GRPOConfig checkpoints activations) and the library's (the pool is freed)
    s.add_argument("--no_gradient_checkpointing", action="store_true", help="keep activations: faster, more memory")
    s.add_argument("--keep_memory", action="store_true", help="keep the KV pool and CUDA graphs between rollouts")
    s.add_argument("--packing", action="store_true", help="padding-free training forward (varlen flash attention)")
    s.add_argument("--lora_rank", type=int, default=0,
                   help="train LoRA adapters of this rank on all linear layers (alpha 2 x rank, as the peer's LORA=R)")
    s.add_argument("--lora_experts", action="store_true",
                   help="with --lora_rank on an MoE model: adapters on the experts too (PEFT's target_parameters; "
                        "the peer's LORA_EXPERTS=1)")
    s.add_argument("--adam_state_dtype", choices=("float32", "bfloat16"), default="float32",
                   help="AdamW moments in bf16 (stochastic rounding): 4 bytes a parameter less")
    s.add_argument("--no_master_weights", action="store_true",
                   help="the bf16 weights updated in place with stochastic rounding, no fp32 masters (the module's "
                        "master_weights=False): with --adam_state_dtype bfloat16, the peer's 8 bytes a parameter")
    s.add_argument("--optimizer_offload", action="store_true",
                   help="AdamW's masters and moments in host memory, the step on the CPU")
    s.add_argument("--score_during_generation", action="store_true",
                   help="score completions as they end, while the rest decode (the module's option)")
    s.add_argument("--stop_tokens", type=int, default=0,
                   help="the first N token ids end a completion: uneven lengths, where the default forces all to full")
    s.add_argument("--reward_ms", type=float, default=0.0,
                   help="the reward also computes for this many ms of Python a completion (a verifier's cost)")
    s.add_argument("--reward_wait_ms", type=float, default=0.0,
                   help="the reward also waits this many ms a completion, not holding the interpreter (a sandbox's "
                        "subprocess, a judge behind HTTP)")
    s.add_argument("--lengths", choices=("model", "lognormal"), default="model",
                   help="lognormal: each sample ends at a length drawn from a log-normal of median new_tokens / 8 and "
                        "sigma 1, capped at new_tokens (a reasoning run's long tail; the random model's token there "
                        "becomes a stop token); model: where the model stops (see --stop_tokens)")
    s.add_argument("--streaming", action="store_true", help="streaming GRPO (the module's streaming=True)")
    s.add_argument("--max_staleness", type=int, default=4, help="with --streaming (the module's option)")
    s.add_argument("--max_inflight_tasks", type=int, default=-1, help="with --streaming (the module's option)")
    s.add_argument("--decode_steps_during_training", type=int, default=0,
                   help="with --streaming: decode steps beside each step's scoring and training (the module's option; "
                        "-1: until the training is done)")
    s.add_argument("--beside_priority", type=int, default=0,
                   help="the CUDA stream priority of the decode steps beside training (the engine's option; lower is "
                        "sooner)")
    s.add_argument("--max_num_seqs", type=int, default=0,
                   help="sequences in one decode step (the engine's option; 0: 256, or prompts x generations if more)")
    s.add_argument("--devices", type=int, default=1, help="GPUs, one process each (Lightning starts the others)")
    s.add_argument("--strategy", choices=("auto", "ddp", "fsdp2", "tp"), default="auto",
                   help="with --devices > 1: ddp, fsdp2 (FSDP shards; rollouts on the gathered model), or tp (each "
                        "device holds its share of every layer's heads and MLP columns, and all decode each rollout)")
    return p


def _peak_gb(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else float("nan")


def bench_rollout(args) -> dict:
    from rlcu.contracts import Numerics
    from rlcu.engine.llm_engine import EngineConfig, LLMEngine
    from rlcu.rollout.base import SamplingParams

    model, tok = build_model(args.model, args.device, args.dtype)
    model.eval()
    n_prompts = -(-args.sequences // args.generations)
    prompts = random_prompt_ids(n_prompts, args.prompt_len, model.config.vocab_size)
    requests = [p for p in prompts for _ in range(args.generations)][:args.sequences]
    if not model.native:
        return bench_reference_rollout(args, model, requests)
    engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=max(256, args.sequences),
                                           cuda_graphs=not args.no_cuda_graphs, release_memory=False,
                                           lookahead=args.lookahead, shared_prefix=SHARED_PREFIX[args.shared_prefix],
                                           kv_cache_dtype=args.kv_cache_dtype,
                                           mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                                           numerics=Numerics.EXACT if args.exact_logprobs else Numerics.FAST))
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0)  # no stop ids: full length
    continuation = None
    if args.turns > 1:
        sampling, continuation = episodes(args, model.config.vocab_size)
    elif args.http:
        raise ValueError("--http runs episodes: give --turns 2 or more")
    runs, http_runs = [], []
    from rlcu.agents.workers import ProgramWorkers, resolve_processes

    processes = resolve_processes(args.agent_processes, HTTPEpisode) if args.http else 0
    workers = ProgramWorkers(processes) if processes else None
    try:
        for i in range(1 + args.repeats):
            tokens, seconds = timed_rollout(args, engine, requests, sampling, continuation, i)
            runs.append(seconds)
            if args.http:
                http_runs.append(timed_http_rollout(args, engine, requests, sampling, tok, model.config.vocab_size,
                                                    i, tokens, workers))
    finally:
        if workers is not None:
            workers.close()
    best = min(runs[1:]) if args.repeats else runs[0]
    http = {}
    if args.http:
        http_best = min(http_runs[1:]) if args.repeats else http_runs[0]
        timed = slice(1, None) if args.repeats else slice(None)
        # the best runs' ratio, and the medians' (steadier when the runs spread as wide as the gap)
        http = dict(http=True, agent_processes=processes, http_seconds=round(http_best, 3),
                    http_tok_per_s=round(tokens / http_best), http_ratio=round(best / http_best, 3),
                    http_ratio_median=round(statistics.median(runs[timed]) / statistics.median(http_runs[timed]), 3))
    profile = profile_rollout(args, engine, requests, sampling, continuation) if args.profile else {}
    return dict(bench="rollout", model=args.model, path="native", sequences=args.sequences,
                generations=args.generations, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                cuda_graphs=not args.no_cuda_graphs,
                lookahead=args.lookahead, shared_prefix=args.shared_prefix, turns=args.turns,
                kv_cache_dtype=args.kv_cache_dtype, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                exact_logprobs=args.exact_logprobs, tokens=tokens,
                seconds=round(best, 3), tok_per_s=round(tokens / best),
                ms_per_step=round(1e3 * best / engine.stats["steps"], 2),
                peak_GB=round(_peak_gb(args.device), 1), device=_device_name(args.device), **http,
                **({"profile": profile} if profile else {}))


def timed_rollout(args, engine, requests, sampling, continuation, i: int) -> tuple[int, float]:
    """(sampled tokens, seconds) of one rollout, printed as run `i`."""
    _sync(args.device)
    start = time.perf_counter()
    out = engine.generate(requests, sampling, continuation)
    _sync(args.device)
    seconds = time.perf_counter() - start
    tokens = sum(map(sum, out.tool_mask)) if out.tool_mask else sum(len(c) for c in out.completion_ids)
    print(f"  run {i}{' (warm-up)' if i == 0 else ''}: {tokens} tokens in {seconds:.2f} s "
          f"= {tokens / seconds:,.0f} tok/s, {engine.stats['steps']} engine steps, "
          f"{engine.stats['waiting_s']:.2f} s waiting for replies (a reply {engine.stats['mean_reply_ms']:.1f} ms "
          f"after its turn ended; {engine.stats['replies_pending_s']:.2f} s with a reply pending)", file=sys.stderr)
    return tokens, seconds


def timed_http_rollout(args, engine, requests, sampling, tokenizer, vocab_size: int, i: int, tokens: int,
                       workers=None) -> float:
    """Seconds of the same episodes as `episodes()` makes them, each run by an agent program that calls the agent
    endpoint once a turn over HTTP (aiohttp; token ids in, `token_ids` out), from the endpoint's start to its stop.
    `tokens`: what the in-process run sampled; the HTTP run must sample as many."""
    from dataclasses import replace

    from rlcu.agents.programs import ProgramRunner

    _sync(args.device)
    start = time.perf_counter()
    program = HTTPEpisode(args.turns, sampling.max_turn_tokens, random_prompt_ids(1, args.turn_tokens, vocab_size,
                                                                                seed=1)[0])
    runner = ProgramRunner([{"prompt": ids} for ids in requests], program, None, "bench", sampling.max_tokens,
                           timeout=3600, tokenizer=tokenizer, workers=workers)
    try:
        out = engine.generate(runner.prompt_ids, replace(sampling, first_turn_tokens=runner.first_turn_tokens),
                              runner)
        runner.record()
    finally:
        runner.close()
    _sync(args.device)
    seconds = time.perf_counter() - start
    sampled = sum(map(sum, out.tool_mask))
    if sampled != tokens:
        raise RuntimeError(f"the HTTP episodes sampled {sampled} tokens, the in-process ones {tokens}")
    print(f"  run {i} over HTTP{' (warm-up)' if i == 0 else ''}: {sampled} tokens in {seconds:.2f} s "
          f"= {sampled / seconds:,.0f} tok/s, {engine.stats['steps']} engine steps, "
          f"{engine.stats['waiting_s']:.2f} s waiting for replies (a reply {engine.stats['mean_reply_ms']:.1f} ms "
          f"after its turn ended; {engine.stats['replies_pending_s']:.2f} s with a reply pending)", file=sys.stderr)
    return seconds


@dataclass(frozen=True)
class HTTPEpisode:
    """An agent program of `turns` /v1/completions calls of `per_turn` tokens each, the prompt growing by the
    served token ids and then `appended`, `episodes()`'s environment tokens (sent as the next prompt's addition,
    which the endpoint masks out of the loss as the in-process continuation's are). A class, so that it pickles
    for --agent_processes."""
    turns: int
    per_turn: int
    appended: list[int]

    async def __call__(self, endpoint, row):
        import aiohttp

        ids = list(row["prompt"])
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {endpoint.api_key}"}) as session:
            for turn in range(self.turns):
                body = {"model": endpoint.model, "prompt": ids, "max_tokens": self.per_turn}
                async with session.post(endpoint.base_url + "/completions", json=body) as response:
                    out = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {out}")
                ids += out["choices"][0]["token_ids"] + (self.appended if turn < self.turns - 1 else [])


def bench_reference_rollout(args, model, requests) -> dict:
    """A model without a native family: the rollouts GRPOModule gives it (the reference backend, over rlcu's static
    cache where the model allows, `rlcu/models/hf_decode.py`), all the sequences as one lockstep batch."""
    from rlcu.engine.llm_engine import EngineConfig
    from rlcu.rollout.base import SamplingParams
    from rlcu.rollout.reference import ReferenceRollout

    if (args.turns > 1 or args.profile or args.exact_logprobs or args.kv_cache_dtype != "auto"
            or args.mamba_ssm_cache_dtype != EngineConfig.mamba_ssm_cache_dtype):
        raise ValueError(f"{args.model} runs on the transformers fallback: --turns, --profile, --exact_logprobs, "
                         "--kv_cache_dtype and --mamba_ssm_cache_dtype measure the native engine only")
    backend = ReferenceRollout(max_batch_size=len(requests))
    backend.setup(model)
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0)
    runs = []
    for i in range(1 + args.repeats):
        _sync(args.device)
        start = time.perf_counter()
        out = backend.generate(requests, sampling)
        _sync(args.device)
        runs.append(time.perf_counter() - start)
        tokens = sum(len(c) for c in out.completion_ids)
        print(f"  run {i}{' (warm-up)' if i == 0 else ''}: {tokens} tokens in {runs[-1]:.2f} s "
              f"= {tokens / runs[-1]:,.0f} tok/s (transformers fallback)", file=sys.stderr)
    best = min(runs[1:]) if args.repeats else runs[0]
    return dict(bench="rollout", model=args.model, path="fallback", sequences=args.sequences,
                generations=args.generations, prompt_len=args.prompt_len, new_tokens=args.new_tokens, tokens=tokens,
                seconds=round(best, 3), tok_per_s=round(tokens / best), peak_GB=round(_peak_gb(args.device), 1),
                device=_device_name(args.device))


def profile_rollout(args, engine, requests, sampling, continuation) -> dict:
    """One more rollout under the profiler: its wall time against the GPU's busy time (the difference is the
    GPU waiting for the host), its kernels and the host's operators; DIR/trace.json."""
    from rlcu.profiling import phase_kernels, print_phase_kernels, profiler

    with profiler(args.profile) as prof:
        with torch.profiler.record_function("rlcu/generate"):
            engine.generate(requests, sampling, continuation)
            _sync(args.device)
    phases = phase_kernels(prof)
    print_phase_kernels(phases, file=sys.stderr)
    prof.export_chrome_trace(f"{args.profile}/trace.json")
    return {k: dict(wall_ms=round(v["wall_ms"]), busy_ms=round(v["busy_ms"])) for k, v in phases.items()}


def episodes(args, vocab_size: int):
    """Sampling and a continuation for episodes of `args.turns` turns of new_tokens / turns sampled tokens,
    with `args.turn_tokens` random tokens appended after each turn but the last."""
    from rlcu.contracts import Reply, SamplingParams

    per_turn = args.new_tokens // args.turns
    if per_turn < 1 or args.turn_tokens < 1:
        raise ValueError("--turns must be at most --new_tokens, and --turn_tokens at least 1")
    appended = random_prompt_ids(1, args.turn_tokens, vocab_size, seed=1)[0]
    sampling = SamplingParams(max_tokens=per_turn * args.turns + args.turn_tokens * (args.turns - 1) + 1,
                              max_turn_tokens=per_turn, temperature=1.0, seed=0)

    def continuation(turn):
        done = (len(turn.completion_ids) + args.turn_tokens) // (per_turn + args.turn_tokens)  # turns sampled
        return Reply(appended) if done < args.turns else Reply(None)

    return sampling, continuation


def bench_step(args) -> dict:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from rlcu.data.prompts import collate_rows
    from rlcu.engine.llm_engine import EngineConfig
    from rlcu.grpo.module import GRPOModule
    from rlcu.grpo.streaming import Streamer
    from rlcu.profiling import phase_kernels, print_phase_kernels, profiler
    from rlcu.rollout.native import NativeRollout

    if args.prompts % args.devices:
        raise ValueError(f"--prompts {args.prompts} (the whole step's) must divide among --devices {args.devices}")
    # ranks after the first are this command again, started by Lightning with LOCAL_RANK set: each builds
    # the same seeded model on its own GPU
    rank = int(os.environ.get("LOCAL_RANK", 0))
    device = f"cuda:{rank}" if args.device == "cuda" and args.devices > 1 else args.device
    if args.strategy == "tp" and args.model in (*SHAPES, *FAMILY_SHAPES):
        device = "meta"  # each rank's share gets memory and random weights once the model is split (configure_model)
    model, tok = build_model(args.model, device, args.dtype)
    profiled = args.profile_steps if args.profile else 0
    total_steps = args.steps + profiled
    # streaming reads ahead: the batches that fill the stream come on top of the steps (the streamer's own count)
    ahead = (Streamer(None, args.generations, args.max_staleness, args.max_inflight_tasks).steps_in_flight(
        args.prompts // args.devices) if args.streaming else 1)
    prompts = random_prompt_ids(args.prompts * (total_steps + ahead), args.prompt_len, model.config.vocab_size)
    rows = [{"prompt": text} for text in prompt_texts(tok, prompts, args.prompt_len + PROMPT_SLACK)]

    def reward_len(completions, **kwargs):  # the peers' reward: the completion's length in characters
        busy(args.reward_ms * len(completions) / 1e3)
        time.sleep(args.reward_wait_ms * len(completions) / 1e3)
        return [float(len(c)) for c in completions]

    rollout = NativeRollout(EngineConfig(block_size=args.block_size, cuda_graphs=not args.no_cuda_graphs,
                                         lookahead=args.lookahead, shared_prefix=SHARED_PREFIX[args.shared_prefix],
                                         release_memory=not args.keep_memory, kv_cache_dtype=args.kv_cache_dtype,
                                         mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                                         max_num_seqs=args.max_num_seqs or max(256, args.prompts * args.generations),
                                         beside_priority=args.beside_priority))
    module = GRPOModule(model, tokenizer=tok, rewards=[reward_len], rollout=rollout, num_generations=args.generations,
                        max_prompt_length=args.prompt_len + PROMPT_SLACK, max_completion_length=args.new_tokens,
                        micro_batch_size=args.micro_batch_size, learning_rate=1e-6, loss_type="dapo",
                        gradient_checkpointing=not args.no_gradient_checkpointing, packing=args.packing,
                        peft_config=lora_config(args.lora_rank, args.lora_experts),
                        adam_state_dtype=args.adam_state_dtype, master_weights=not args.no_master_weights,
                        optimizer_offload=args.optimizer_offload, exact_logprobs=args.exact_logprobs,
                        score_during_generation=args.score_during_generation, streaming=args.streaming,
                        max_staleness=args.max_staleness, max_inflight_tasks=args.max_inflight_tasks,
                        decode_steps_during_training=args.decode_steps_during_training)
    module.stop_token_ids = list(range(args.stop_tokens))  # by default none: full length, as the peers force it
    if args.lengths == "lognormal":
        module.stop_token_ids = [0]
    steps: list[dict] = []
    profile: dict = {}

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.profile and len(steps) == args.steps and getattr(self, "prof", None) is None:
                self.prof = profiler(args.profile).__enter__()
            _sync(args.device)
            self.retries = _alloc_retries(args.device)
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _sync(args.device)
            if trainer.global_step == len(steps):  # streaming's first batches fill the stream: no step yet
                self.filling = getattr(self, "filling", 0.0) + time.perf_counter() - self.start
                return
            m = trainer.callback_metrics
            steps.append(dict(total=time.perf_counter() - self.start, **{k: float(m[f"timing/{k}"]) for k in PHASES
                                                                       if f"timing/{k}" in m}))
            steps[-1]["tokens"] = float(m["num_tokens"])
            # the caching allocator freed its cache and retried a cudaMalloc (each retry synchronizes the device)
            steps[-1]["alloc_retries"] = _alloc_retries(args.device) - self.retries
            if "streaming/decode_batch_mean" in m:
                steps[-1].update(staleness=float(m["streaming/staleness_mean"]),
                                 dropped=float(m["streaming/dropped_stale"]),
                                 decode_batch=float(m["streaming/decode_batch_mean"]),
                                 decode_steps=float(m["streaming/decode_steps"]),
                                 beside=float(m.get("streaming/decode_steps_beside", 0.0)))
            steps[-1]["mean_length"] = float(m["completions/mean_length"])
            steps[-1]["clipped_ratio"] = float(m["completions/clipped_ratio"])  # the share that reached new_tokens
            if "logprob_mismatch/max" in m:
                steps[-1]["mismatch"] = float(m["logprob_mismatch/max"])
                steps[-1]["mismatch_mean"] = float(m["logprob_mismatch/mean"])
            if "moe/routing_mismatch" in m:
                steps[-1]["routing_mismatch"] = float(m["moe/routing_mismatch"])
            for phase in ("generate", "train"):  # the module's per-phase peaks (CUDA only)
                if f"memory/{phase}_GB" in m:
                    steps[-1][f"peak_{phase}_GB"] = float(m[f"memory/{phase}_GB"])
            phases = ", ".join(f"{k} {steps[-1][k]:.2f}" for k in PHASES if k in steps[-1])
            print(f"  rank {trainer.global_rank} step {batch_idx}: {steps[-1]['total']:.2f} s ({phases}; "
                  f"{steps[-1]['tokens']:.0f} tokens, {steps[-1]['alloc_retries']} allocator retries)", file=sys.stderr)
            if getattr(self, "prof", None) is not None and len(steps) == total_steps:
                self.prof.__exit__(None, None, None)
                phases = phase_kernels(self.prof)
                print_phase_kernels(phases, file=sys.stderr)
                self.prof.export_chrome_trace(f"{args.profile}/trace.json")
                profile.update({k: dict(wall_ms=round(v["wall_ms"]), busy_ms=round(v["busy_ms"]))
                                for k, v in phases.items()})
                self.prof = None

    trainer = L.Trainer(max_steps=total_steps, accelerator="gpu" if args.device.startswith("cuda") else "cpu",
                        devices=args.devices, strategy=args.strategy, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer := Timer()])
    lengths = planned_lengths(args.new_tokens) if args.lengths == "lognormal" else contextlib.nullcontext()
    with lengths:
        # the prompts are split between data-parallel ranks; tensor-parallel ranks all take every prompt
        per_rank = args.prompts // (1 if args.strategy == "tp" else args.devices)
        trainer.fit(module, DataLoader(rows, batch_size=per_rank, collate_fn=collate_rows))
    if not trainer.is_global_zero:
        return None  # rank 0 reports (its memory, its timings: the ranks wait for each other at every step)
    steps = steps[:args.steps]  # without the profiled ones
    # streaming's first steps train on groups the stream decoded while it filled: steady from the first step after
    steady = steps[ahead if args.streaming else 1:] or steps
    mean = {k: round(sum(s[k] for s in steady) / len(steady), 3) for k in ("total", *PHASES) if k in steady[0]}
    peaks = {k: round(max(s.get(k, float("nan")) for s in steps), 1) for k in ("peak_generate_GB", "peak_train_GB")}
    return dict(bench="step", model=args.model, path="native" if module.policy.native else "fallback",
                prompts=args.prompts, generations=args.generations,
                prompt_len=args.prompt_len, new_tokens=args.new_tokens, micro_batch_size=args.micro_batch_size,
                gradient_checkpointing=module.policy.gradient_checkpointing, keep_memory=args.keep_memory,
                lookahead=args.lookahead, packing=args.packing, shared_prefix=args.shared_prefix,
                lora_rank=args.lora_rank, lora_experts=args.lora_experts, adam_state_dtype=args.adam_state_dtype,
                master_weights=not args.no_master_weights, optimizer_offload=args.optimizer_offload,
                kv_cache_dtype=args.kv_cache_dtype, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                exact_logprobs=args.exact_logprobs, devices=args.devices, strategy=args.strategy,
                score_during_generation=args.score_during_generation, stop_tokens=args.stop_tokens,
                reward_ms=args.reward_ms, reward_wait_ms=args.reward_wait_ms, lengths=args.lengths,
                streaming=args.streaming, max_staleness=args.max_staleness,
                max_inflight_tasks=args.max_inflight_tasks,
                decode_steps_during_training=args.decode_steps_during_training,
                beside_priority=args.beside_priority,
                max_num_seqs=rollout.config.max_num_seqs,
                fill_seconds=round(getattr(timer, "filling", 0.0), 2),
                # trained completion tokens per second of the steady steps (after the first)
                trained_tokens_per_s=round(sum(s["tokens"] for s in steady) / sum(s["total"] for s in steady), 1),
                **({"staleness_mean": round(sum(s["staleness"] for s in steady) / len(steady), 2),
                    "dropped_stale": sum(s["dropped"] for s in steps),
                    "decode_batch_mean": round(sum(s["decode_batch"] for s in steady) / len(steady), 1),
                    # decode steps a steady step ran, and of them those beside the training before it
                    "decode_steps_mean": round(sum(s["decode_steps"] for s in steady) / len(steady), 1),
                    "decode_steps_beside_mean": round(sum(s["beside"] for s in steady) / len(steady), 1)}
                   if args.streaming else {}),
                mean_length=round(sum(s["mean_length"] for s in steady) / len(steady), 1),
                clipped_ratio=round(sum(s["clipped_ratio"] for s in steady) / len(steady), 3),
                step_seconds=[round(s["total"], 2) for s in steps], steady=mean,
                logprob_mismatch_max=max((s.get("mismatch", float("nan")) for s in steps), default=float("nan")),
                # the largest of the steps' means, as the max is the largest of their maxima
                logprob_mismatch_mean=max((s.get("mismatch_mean", float("nan")) for s in steps), default=float("nan")),
                **({"routing_mismatch_max": max(s["routing_mismatch"] for s in steps)}
                   if all("routing_mismatch" in s for s in steps) else {}),
                peak_GB=max(peaks.values()) if args.device.startswith("cuda") else float("nan"), **peaks,
                device=_device_name(args.device), **({"profile": profile} if profile else {}))


@contextlib.contextmanager
def planned_lengths(new_tokens: int, sigma: float = 1.0):
    """A reasoning run's lengths on a random model, which never stops on its own: each sample ends (its token
    becomes stop token 0) at a length drawn from a log-normal of median new_tokens / 8, capped at new_tokens, by
    its seed and its place in its submission, the same in the synchronous and the streaming step."""
    from rlcu.engine.scheduler import Scheduler

    postprocess = Scheduler.postprocess

    @functools.cache  # one draw a sample, not one a token: seeding a Random costs the decode loop's host time
    def length(key: tuple[int, int]) -> int:
        return min(new_tokens, max(1, round(random.Random(hash(key)).lognormvariate(math.log(new_tokens / 8), sigma))))

    def planned(self, seqs, tokens, logprobs):
        for i, seq in enumerate(seqs):
            if seq.num_completion_tokens + 1 >= length(seq.draw_key(0)[:2]):
                tokens[i] = 0
        return postprocess(self, seqs, tokens, logprobs)

    Scheduler.postprocess = planned
    try:
        yield
    finally:  # the engine's own rule again for whatever runs next in this process
        Scheduler.postprocess = postprocess


def busy(seconds: float) -> None:
    """Python work for `seconds`, holding the interpreter's lock as a verifier written in Python does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(100))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _alloc_retries(device: str) -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.startswith("cuda") else 0


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def finite(value):
    """JSON without NaN or Infinity (not JSON: strict parsers refuse them): a value that is not a number is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def run(argv: list[str]) -> dict:
    args = parser().parse_args(argv)
    for name in ("prompt_len", "new_tokens", "generations", "sequences", "repeats", "turns", "prompts", "steps",
                 "devices"):
        if getattr(args, name, 1) < 1:  # (each subcommand has some of them)
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "profile_steps", 1) < 1:
        raise ValueError("--profile_steps must be >= 1")
    args.device = resolve_device(args.device)
    if args.profile:  # before any work: a folder that cannot be made fails now, not after the timed runs
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--profile {args.profile}: cannot make that folder ({e.strerror}); "
                             "give a writable path") from e
    result = bench_rollout(args) if args.what == "rollout" else bench_step(args)
    if result is not None:  # (None: a rank other than the first)
        print(json.dumps(finite(result)))
    return result
