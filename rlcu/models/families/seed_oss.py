"""Seed-OSS (ByteDance Seed-OSS-36B): Llama's layers with q/k/v biases (`attention_bias`) and an output projection
whose bias has its own flag (`attention_out_bias`, off in the released checkpoints)."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("seed_oss", "SeedOssForCausalLM"))
