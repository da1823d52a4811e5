"""The gated MLP's activation on the fused gate/up projection: act(gate) * up, where gate and up are the two halves
of the last dimension and act is SiLU (Llama, Qwen: SwiGLU) or tanh-approximated GELU (Gemma: GeGLU), rounded at
the same points as the unfused PyTorch code (act(gate) to the input's dtype, then the product)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton

ACTIVATIONS = ("silu", "gelu_tanh")


def gated_mul_reference(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    return gated_mul_reference(gate_up, "silu")


if HAS_TRITON:
    @triton.jit
    def _act(g, GELU: tl.constexpr):
        """(act(g), d act / d g) in fp32."""
        if GELU:  # 0.5 g (1 + tanh(c (g + 0.044715 g^3))), tanh(u) = 2 sigmoid(2u) - 1
            # |u| > 15: tanh is +-1 in fp32 already (and exp(-2u) would overflow)
            u = tl.minimum(tl.maximum(0.7978845608028654 * (g + 0.044715 * g * g * g), -15.0), 15.0)
            t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
            return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 3 * 0.044715 * g * g)
        sig = 1.0 / (1.0 + tl.exp(-g))
        return g * sig, sig * (1.0 + g * (1.0 - sig))

    @triton.jit
    def _gated_mul_kernel(GU, OUT, stride_row, n_cols, BLOCK: tl.constexpr, GELU: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(GU + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_row + n_cols + cols, mask=mask, other=0.0)
        act = _act(g, GELU)[0].to(GU.dtype.element_ty)
        tl.store(OUT + row * n_cols + cols, (act.to(tl.float32) * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_mul_backward_kernel(GU, DOUT, DGU, stride_row, n_cols, BLOCK: tl.constexpr, GELU: tl.constexpr):
        """d up = dout * act(gate); d gate = dout * up * act'(gate)."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(GU + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act, dact = _act(g, GELU)
        act = act.to(GU.dtype.element_ty).to(tl.float32)
        dt = DGU.dtype.element_ty
        tl.store(DGU + row * 2 * n_cols + cols, (dout * u * dact).to(dt), mask=mask)
        tl.store(DGU + row * 2 * n_cols + n_cols + cols, (dout * act).to(dt), mask=mask)


def gated_mul_triton(gate_up, activation: str = "silu"):
    *lead, two_n = gate_up.shape
    n = two_n // 2
    gu = _rows(gate_up)
    out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    _gated_mul_kernel[(gu.shape[0], triton.cdiv(n, 1024))](gu, out, gu.stride(0), n, BLOCK=1024,
                                                            GELU=activation == "gelu_tanh")
    return out.view(*lead, n)


def silu_mul_triton(gate_up):
    return gated_mul_triton(gate_up, "silu")


def _rows(gate_up):
    gu = gate_up.reshape(-1, gate_up.shape[-1])
    return gu if gu.stride(-1) == 1 else gu.contiguous()


def gated_mul_backward_triton(gate_up, dout, activation: str = "silu"):
    gu, n = _rows(gate_up), gate_up.shape[-1] // 2
    d = dout.reshape(-1, n).contiguous()
    dgu = torch.empty((gu.shape[0], 2 * n), dtype=gate_up.dtype, device=gate_up.device)
    _gated_mul_backward_kernel[(gu.shape[0], triton.cdiv(n, 1024))](gu, d, dgu, gu.stride(0), n, BLOCK=1024,
                                                                     GELU=activation == "gelu_tanh")
    return dgu.view(gate_up.shape)


class GatedMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, activation="silu"):
        ctx.save_for_backward(gate_up)
        ctx.activation = activation
        return gated_mul_triton(gate_up, activation)

    @staticmethod
    def backward(ctx, dout):
        return gated_mul_backward_triton(ctx.saved_tensors[0], dout, ctx.activation), None




def gated_mul(gate_up, activation: str = "silu"):
    """Triton on CUDA (with its backward when gradients are recorded); the PyTorch reference elsewhere."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated MLP activation {activation!r}: rlcu has {', '.join(ACTIVATIONS)}")
    if not use_triton(gate_up):
        return gated_mul_reference(gate_up, activation)
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return GatedMulFunction.apply(gate_up, activation)
    return gated_mul_triton(gate_up, activation)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts: with gate and up the two halves, gate clamped above at `limit` and up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate). PyTorch (its gradients by autograd)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def silu_mul(gate_up):
    return gated_mul(gate_up, "silu")
