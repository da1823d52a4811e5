"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (three of each four layers), with
transformers' parameter names.

Where full attention reads every earlier key, this layer reads a state each sequence carries: the short
convolution's last inputs and the delta rule's matrix per value head (`rlcu/kernels/gated_delta.py`). What
differs between training, the reference rollout and the engine is only where a sequence's state comes from and
goes, which the forward's attention context says (`Segments`): training starts every sequence from zeros and
keeps nothing; the engine reads each sequence's state from its pool slot and writes it back."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlcu.kernels.gated_delta import (
    causal_conv,
    causal_conv_exact,
    causal_conv_step,
    causal_conv_step_,
    gated_delta_exact,
    gated_delta_rule,
    gated_delta_step_,
    gates,
)
from rlcu.kernels.rmsnorm import rms_norm
from rlcu.models.config import ModelConfig
from rlcu.models.fused_linear import FusedLinear


@dataclass
class Segments:
    """How the [B, T] tokens of a forward split into sequences, and the state each brings.
    `cu` [N + 1]: where each sequence starts among the B * T tokens taken row after row; `conv` [N, C, K - 1] and
    `state` [N, Hv, Dk, Dv]: each sequence's state before its first token here (None: zeros); `mask` [B, T]: the
    real tokens of a padded batch (padding is zeroed before the layer reads it, so it leaves states at zero);
    `decode`: one token a sequence. `pool`, `conv_pool` and `slots`: instead of `state` and `conv`, where a decode
    step's states live (the engine's pools, [S, Hv, Dk, Dv] and [S, C, K - 1], and each sequence's slot), updated
    there in place."""

    cu: torch.Tensor
    conv: torch.Tensor | None = None
    state: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    decode: bool = False
    pool: torch.Tensor | None = None
    conv_pool: torch.Tensor | None = None
    slots: torch.Tensor | None = None


def rows_as_sequences(batch: int, length: int, device, mask: torch.Tensor | None = None) -> Segments:
    """Each of the B rows one sequence from zero state: training's padded batches."""
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)
    return Segments(cu, mask=mask)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times SiLU of the gate: normalised in fp32, rounded to the input's dtype
    before the weight, the gate applied in fp32 (transformers' order), in one kernel (`rms_norm`'s gate), whose
    sums are a row's own whatever the batch (exact numerics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, gate=gate)


class GatedDeltaNet(nn.Module):
    """One projection of the input into q/k/v (through the convolution), the output gate z, beta's and the
    decay's logits; the delta rule over the sequence; a gated norm per value head; the output projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = cfg.linear_conv_channels
        self.splits = (key_dim, key_dim, value_dim)
        self.in_proj = FusedLinear(cfg.hidden_size, {"in_proj_qkv": self.conv_dim, "in_proj_z": value_dim,
                                                     "in_proj_b": self.num_v_heads, "in_proj_a": self.num_v_heads},
                                   False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = FusedLinear(value_dim, {"out_proj": cfg.hidden_size}, False)

    def forward(self, x, cos, sin, attention):
        """x [B, T, H] -> [B, T, H]; `cos`/`sin` are unused (no positions: the state orders the tokens)."""
        b, t, _ = x.shape
        seg: Segments = attention.segments(self.layer_idx, b, t, x.device)
        if seg.mask is not None:
            x = x * seg.mask[..., None].to(x.dtype)
        exact = attention.batch_invariant
        mixed, z, beta_logit, a = self.in_proj.split(self.in_proj(x, exact))
        mixed, a, beta_logit = mixed.reshape(b * t, -1), a.reshape(b * t, -1), beta_logit.reshape(b * t, -1)
        o = (self._mix_exact if exact else self._mix)(mixed, a, beta_logit, seg, attention)
        o = self.norm(o, z.reshape(b * t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(b, t, -1), exact)

    def _heads(self, mixed: torch.Tensor):
        q, k, v = mixed.split(self.splits, dim=-1)
        q, k = (x.unflatten(-1, (self.num_k_heads, self.head_k_dim)) for x in (q, k))
        return q, k, v.unflatten(-1, (self.num_v_heads, self.head_v_dim))

    def _mix(self, mixed, a, beta_logit, seg: Segments, attention):
        """The convolution and the delta rule: prefill and training in chunks, decode steps a token each."""
        if seg.conv_pool is not None:  # a decode step: each window shifted where it lies
            mixed, conv = causal_conv_step_(mixed, self.conv1d.weight[:, 0], seg.conv_pool, seg.slots), None
        elif seg.decode and seg.conv is not None:  # one token a sequence, after its window
            mixed, conv = causal_conv_step(mixed, self.conv1d.weight[:, 0], seg.conv)
        else:
            mixed, conv = causal_conv(mixed, self.conv1d.weight[:, 0], seg.cu, seg.conv)
        q, k, v = self._heads(mixed)
        if seg.pool is not None:
            o, state = gated_delta_step_(q, k, v, a, beta_logit, self.A_log, self.dt_bias, seg.pool, seg.slots), None
        else:
            g, beta = gates(a, beta_logit, self.A_log, self.dt_bias)
            o, state = gated_delta_rule(q, k, v, g, beta, seg.cu, seg.state, seg.decode)
        attention.keep(self.layer_idx, conv, state)
        return o

    def _mix_exact(self, mixed, a, beta_logit, seg: Segments, attention):
        """Exact numerics: every token as a decode step computes it, in prefill chunks and training alike
        (`causal_conv_exact`, `gated_delta_exact`), so the sums never depend on the chunking or the batch."""
        if seg.pool is not None:  # a decode step: the states where they lie, updated in place
            conv, state, slots = seg.conv_pool, seg.pool, seg.slots
        else:
            n, dev = len(seg.cu) - 1, mixed.device
            # the states gathered from the pool (copies, `StatePool.read`) advance in place, then `keep` puts them back
            conv = (seg.conv.to(mixed.dtype) if seg.conv is not None else
                    mixed.new_zeros(n, self.conv_dim, self.conv1d.weight.shape[-1] - 1))
            state = (seg.state.float() if seg.state is not None else
                     torch.zeros(n, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=dev))
            slots = torch.arange(n, device=dev)
        mixed = causal_conv_exact(mixed, self.conv1d.weight[:, 0], seg.cu, conv, slots)
        o = gated_delta_exact(*self._heads(mixed), a, beta_logit, self.A_log, self.dt_bias, seg.cu, state, slots)
        if seg.pool is None:
            attention.keep(self.layer_idx, conv, state)
        return o


def ungroup_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next's checkpoint layout -> Qwen3.5's, which this layer reads: Qwen3-Next stores q, k, v and z rows
    (`in_proj_qkvz`) and beta's and the decay's rows (`in_proj_ba`) interleaved per key head; Qwen3.5 stores all
    queries, then all keys, then all values (`in_proj_qkv`), then z, b and a apart. Value heads keep their order."""
    dk, dv, hk = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    state = dict(state)
    for key in [k for k in state if k.endswith("linear_attn.in_proj_qkvz.weight")]:
        p = key[: -len("in_proj_qkvz.weight")]
        q, k, v, z = state.pop(key).unflatten(0, (hk, -1)).split([dk, dk, r * dv, r * dv], dim=1)
        state[f"{p}in_proj_qkv.weight"] = torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
        state[f"{p}in_proj_z.weight"] = z.flatten(0, 1)
        b, a = state.pop(f"{p}in_proj_ba.weight").unflatten(0, (hk, -1)).split([r, r], dim=1)
        state[f"{p}in_proj_b.weight"], state[f"{p}in_proj_a.weight"] = b.flatten(0, 1), a.flatten(0, 1)
    return state


def group_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `ungroup_projections`: Qwen3.5's layout -> Qwen3-Next's, for export."""
    dk, dv, hk = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads
    state = dict(state)
    for key in [k for k in state if k.endswith("linear_attn.in_proj_qkv.weight")]:
        p = key[: -len("in_proj_qkv.weight")]
        q, k, v = state.pop(key).split([hk * dk, hk * dk, cfg.linear_num_value_heads * dv])
        z = state.pop(f"{p}in_proj_z.weight")
        per_head = [x.unflatten(0, (hk, -1)) for x in (q, k, v, z)]
        state[f"{p}in_proj_qkvz.weight"] = torch.cat(per_head, dim=1).flatten(0, 1)
        b, a = (state.pop(f"{p}in_proj_{n}.weight").unflatten(0, (hk, -1)) for n in "ba")
        state[f"{p}in_proj_ba.weight"] = torch.cat([b, a], dim=1).flatten(0, 1)
    return state
