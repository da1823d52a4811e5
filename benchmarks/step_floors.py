"""The floors of a GRPO step of P x G x L on one GPU, from a model's transformers config: the least time its
generation can take (every decode step reads the weights, the keys and values of each sequence's context, and a
hybrid's recurrent states, at the GPU's bandwidth) and the least its training can take (the matmul FLOPs at the GPU's
dense bf16 rate), and what a ratio to a peer's step asks of them.

    python3 benchmarks/step_floors.py [--tflops 788] [--tbps 4.24] [--sampler_bytes 2] NAME[:lora][:RLCU_S:PEER_S] ...

NAME is one of `rlcu bench`'s FAMILY_SHAPES (dense or linear-attention hybrid; not MoE). `:lora` counts a LoRA step
(the frozen weights' gradients are not computed). RLCU_S and PEER_S, measured steps, add what share of the floor
each is at and what 10x the peer asks for. The defaults are the rates measured on the benchmarks' H200 on
2026-11-29 (a bf16 8192^3 matmul, a device-to-device copy's bytes read and written). The model is built on the meta
device: nothing is allocated.

What is counted, for the step's P x G sequences, each of a prompt of --prompt_len tokens and L new ones:
- decode: L steps, each reading the matmul weights once (the LM head included; an untied embedding's lookup reads
  a few rows and is left out), every attention layer's keys and values over each sequence's own tokens and its
  group's prompt, read once for the G sequences that share it (a sliding window caps both), both in bf16 (FP8 with
  --sampler_bytes 1), and each linear-attention layer's fp32 state and convolution window, read and written;
- prefill: 2 FLOPs a matmul weight a prompt token;
- training: 2 FLOPs a matmul weight a token for each forward, each recompute under activation checkpointing and
  each half of the backward (the weights' gradient is skipped under LoRA), plus causal attention's score and value
  products at the same multiples;
- the optimizer (full fine-tuning): AdamW over fp32 masters and moments, about 30 bytes a parameter moved.
Kernel launches, sampling, the loss's softmax, norms and elementwise work are left out: a floor, not an estimate."""
import argparse

import torch

from rlcu.bench import FAMILY_SHAPES, family_config


def geometry(name: str) -> dict:
    """Matmul weights, parameters, and per-layer cache bytes of a FAMILY_SHAPES model, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    cfg = family_config(name)
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        raise SystemExit(f"{name}: a mixture of experts; its decode reads the experts its rows route to, "
                         "which this floor does not model")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    params = {id(p): p.numel() for p in model.parameters()}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    layers = []
    for kind in types:
        if kind == "linear_attention":
            hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            conv = (2 * hk * dk + hv * dv) * (cfg.linear_conv_kernel_dim - 1) * 2
            layers.append(dict(state=2 * (hv * dk * dv * 4 + conv)))  # read and written each step
        else:
            layers.append(dict(kv=2 * kv_heads * head_dim, window=window if kind == "sliding_attention" else None,
                               width=cfg.num_attention_heads * head_dim))
    return dict(matmul=sum(linear.values()), params=sum(params.values()), layers=layers)


def floors(g: dict, *, groups: int, seqs: int, prompt: int, new: int, lora: bool, recompute: bool, flops: float,
           bandwidth: float, sampler_bytes: float = 2) -> dict:
    """Seconds of each phase at the floor (see the module's docstring); the sampler reads weights and keys and values
    of `sampler_bytes` an element (2: bf16; 1: an FP8 sampler, whose samples come from another policy than the
    trainer's bf16 one)."""
    weight_bytes = sampler_bytes * g["matmul"]
    decode_bytes = 0.0
    for t in range(new):
        step = weight_bytes
        for layer in g["layers"]:
            if "state" in layer:
                step += seqs * layer["state"]
                continue
            window = layer["window"] or prompt + new
            own = min(t + 1, window)  # each sequence's own tokens, then the group's prompt, read once a group
            step += sampler_bytes * layer["kv"] * (seqs * own + groups * min(prompt, window - own))
        decode_bytes += step
    tokens = seqs * (prompt + new)
    passes = (1 + recompute) + (1 if lora else 2)  # forwards, then the backward's input (and weight) gradients
    attn = sum(4 * layer["width"] * seqs * (prompt + new) * (prompt + new + 1) / 2
               for layer in g["layers"] if "kv" in layer)
    train = passes * (2 * g["matmul"] * tokens + attn) / flops
    optimizer = 0.0 if lora else 30 * g["params"] / bandwidth
    return dict(decode=decode_bytes / bandwidth, prefill=2 * g["matmul"] * seqs * prompt / flops, train=train,
                optimizer=optimizer)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="NAME[:lora][:RLCU_S:PEER_S]")
    ap.add_argument("--tflops", type=float, default=788.0, help="dense bf16 matmul rate, TFLOP/s")
    ap.add_argument("--tbps", type=float, default=4.24, help="memory bandwidth, TB/s")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--new_tokens", type=int, default=512)
    ap.add_argument("--sampler_bytes", type=float, default=2,
                    help="bytes an element of the weights and the keys and values the sampler reads (1: FP8)")
    args = ap.parse_args()
    print("| model | decode | prefill + optimizer | train (recompute) | floor | floor without recompute "
          "| rlcu step: share of floor | 10x the peer | 10x asks of the floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in args.runs:
        name, *rest = run.split(":")
        if name not in FAMILY_SHAPES:
            raise SystemExit(f"{name}: not one of rlcu bench's shapes ({', '.join(FAMILY_SHAPES)})")
        lora = bool(rest) and rest[0] == "lora"
        measured = [float(x) for x in rest[lora:]]
        g = geometry(name)
        kw = dict(groups=args.prompts, seqs=args.prompts * args.generations, prompt=args.prompt_len,
                  new=args.new_tokens, lora=lora, flops=args.tflops * 1e12, bandwidth=args.tbps * 1e12,
                  sampler_bytes=args.sampler_bytes)
        f, bare = floors(g, recompute=True, **kw), floors(g, recompute=False, **kw)
        total, total_bare = sum(f.values()), sum(bare.values())
        cells = ["", "", ""]
        if len(measured) == 2:
            ours, peer = measured
            cells = [f"{total / ours:.0%} ({ours:.2f} s)", f"{peer / 10:.2f} s",
                     f"{total / (peer / 10):.0%} ({total_bare / (peer / 10):.0%} without recompute)"]
        print(f"| {name}{' LoRA' if lora else ''} | {f['decode']:.2f} s | {f['prefill'] + f['optimizer']:.2f} s "
              f"| {f['train']:.2f} s | **{total:.2f} s** | {total_bare:.2f} s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
