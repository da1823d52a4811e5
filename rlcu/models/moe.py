"""Mixture-of-experts MLP (Qwen3-MoE, OLMoE, Qwen2-MoE, Granite-MoE, gpt-oss): a router picks `top_k` of
`num_experts` gated MLPs for each token, and the token's output is their outputs weighted by the router's
probabilities.

Experts are stored stacked, as transformers 5 holds them in memory (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); checkpoints name one module per expert (`experts.{e}.gate_proj.weight`), which
`join_expert_parts` and `split_expert_parts` convert at the folder's boundary, as `fused_linear.py` does for q/k/v.

Dispatch sorts the tokens' (token, slot) pairs by expert, so that each expert's rows are contiguous, and runs
both projections as one grouped GEMM (`grouped_linear`); `rlcu/kernels/moe_dispatch.py` sorts a decode step's
pairs and combines its rows in one launch each. The weighted sum over a token's k experts is taken in a fixed order
(slot 0 first), so a token's output does not depend on the other tokens of its batch once each
expert's GEMM does not either (`Numerics.EXACT`: the batch-invariant grouped kernel, one launch for every expert
with the counts read on the device, so exact decode steps are CUDA graphs too). The sampler and the
trainer run this same module, so their routing is the same computation: there is nothing to replay."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlcu.kernels._triton import use_triton
from rlcu.kernels.matmul import GroupRows, grouped_linear_triton, invariant_grouped_linear, invariant_linear
from rlcu.kernels.moe_dispatch import combine, dispatch, route, route_reference
from rlcu.kernels.silu_mul import clamped_swiglu, gated_mul

TRITON_ROWS = 16  # rows an expert on average below which the sampler's forward takes the Triton grouped kernel


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's grouped GEMM (one launch for every expert, no host synchronisation: CUDA-graph safe) takes bf16 on
    Hopper and newer; elsewhere the experts run one GEMM each, which reads the counts on the host."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] >= 9)


def grouped(x: torch.Tensor, batch_invariant: bool = False, sampler: bool = False) -> bool:
    """Whether `grouped_linear` runs every group in one launch that reads the counts on the device: the
    batch-invariant grouped kernel in exact mode and in the sampler's forwards (wherever Triton runs), else torch's
    grouped GEMM for x (in the dtype autocast gives it)."""
    return (batch_invariant or sampler) and use_triton(x) or grouped_mm_supported(x.device, _compute_dtype(x))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def vendor_grouped(x: torch.Tensor, groups: int, batch_invariant: bool = False, sampler: bool = False) -> bool:
    """Whether a grouped launch of x's rows over `groups` groups takes torch's grouped GEMM (else the Triton
    kernel): in the default mode, where it runs, unless the forward is the sampler's and the groups average fewer
    than `TRITON_ROWS` rows (a decode step's), where the kernel reads the experts' weights faster."""
    if batch_invariant or not grouped_mm_supported(x.device, _compute_dtype(x)):
        return False
    return not sampler or not use_triton(x) or x.shape[0] >= TRITON_ROWS * groups


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: GroupRows | torch.Tensor | list[int],
                   batch_invariant: bool = False, sampler: bool = False) -> torch.Tensor:
    """x [M, K] sorted by group, weight [G, N, K], counts [G] rows of each group -> [M, N] (x_g @ weight_g.T).
    The grouped form reads the counts on the device (`GroupRows`: what it derives from them made once for a
    layer's launches); the loop form needs them on the host (a list: read once by the caller for both of a
    layer's projections, or a tensor, read here)."""
    if isinstance(counts, torch.Tensor | GroupRows) and grouped(x, batch_invariant, sampler):
        groups = counts if isinstance(counts, GroupRows) else GroupRows(counts)
        if batch_invariant:
            return invariant_grouped_linear(x, weight, groups)
        dtype, vendor = _compute_dtype(x), vendor_grouped(x, weight.shape[0], sampler=sampler)  # autocast's state
        with torch.autocast(x.device.type, enabled=False):  # cast by hand, as autocast would F.linear's inputs
            if vendor:
                return torch._grouped_mm(x.to(dtype), weight.to(dtype).transpose(-2, -1), offs=groups.ends())
            return grouped_linear_triton(x.to(dtype), weight.to(dtype), groups)  # the sampler's: no gradient
    if isinstance(counts, GroupRows):
        counts = counts.counts
    out, start = [], 0
    for g, n in enumerate(counts if isinstance(counts, list) else counts.tolist()):
        if n:
            rows = x[start:start + n]
            # a caller that read the counts on the host; an expert's rows change in number at every call: the
            # kernel, never a vendor check a call
            out.append(invariant_linear(rows, weight[g], vendor=False) if batch_invariant
                       else F.linear(rows, weight[g]))
        start += n
    return torch.cat(out) if out else x.new_zeros(0, weight.shape[1])


class Experts(nn.Module):
    """`bias`: each projection adds its expert's bias (gpt-oss: `gate_up_proj_bias` [E, 2I], `down_proj_bias`
    [E, H]). `activation`: "silu" or "gelu_tanh" (the fused kernel), or "clamped_swiglu" with `swiglu` =
    (alpha, limit)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str, bias: bool = False,
                 swiglu: tuple[float, float] = (1.702, 7.0)):
        super().__init__()
        self.num_experts, self.activation, self.swiglu = num_experts, activation, swiglu
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.bias = bias
        self.lora: nn.ModuleDict | None = None  # ExpertAdapter per targeted projection (`rlcu/models/lora.py`)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.activation == "clamped_swiglu":
            return clamped_swiglu(gate_up, *self.swiglu)
        return gated_mul(gate_up, self.activation)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                batch_invariant: bool = False, sampler: bool = False) -> torch.Tensor:
        """x [T, H], experts and weights [T, k] -> [T, H]. `sampler`: the engine's forward (no gradient), which may
        take kernels that round otherwise than the trainer's forwards (`SparseMoE.forward`)."""
        d = dispatch(experts, self.num_experts)
        # one host read for both projections, or the grouped launches' offsets made once for them
        counts = GroupRows(d.counts, d.ends) if grouped(x, batch_invariant, sampler) else d.counts.tolist()
        rows = x[d.tokens]
        gate_up = self._project("gate_up_proj", rows, counts, batch_invariant, sampler)
        if self.bias:
            by_row = experts.reshape(-1)[d.order]  # each sorted row's expert
            gate_up = gate_up + self.gate_up_proj_bias[by_row].to(gate_up.dtype)
        y = self._project("down_proj", self.act(gate_up), counts, batch_invariant, sampler)
        if self.bias:
            y = y + self.down_proj_bias[by_row].to(y.dtype)
        return combine(y, d, weights)

    def _project(self, name: str, rows: torch.Tensor, counts, batch_invariant: bool, sampler: bool) -> torch.Tensor:
        y = grouped_linear(rows, getattr(self, name), counts, batch_invariant, sampler)
        lora = self.lora[name] if self.lora is not None and name in self.lora else None
        return y if lora is None or not lora.enabled else lora.add_to(y, rows, counts, batch_invariant, sampler)


class SparseMoE(nn.Module):
    """The MLP of an MoE layer: `gate` (the router, [E, H]) and `experts`, plus, where the family has one, a
    `shared_expert` (an MLP every token goes through) scaled by the sigmoid of `shared_expert_gate` ([1, H]).
    With `keep_router_logits` set, each forward that records gradients leaves its router logits [T, E] in
    `router_logits` (the load-balancing loss reads them) and the experts they picked in `router_experts`; the
    engine's forwards, which record none, leave them alone even beside training. A forward given `record` hands it
    (moe_index, experts [T, k]): the engine keeps which experts served each token, beside its KV."""

    def __init__(self, cfg, shared_expert: nn.Module | None = None, moe_index: int = 0):
        super().__init__()
        self.moe_index = moe_index  # this layer's place among the model's MoE layers (`cfg.moe_layers`)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.has_shared = shared_expert is not None
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        spec = cfg.spec
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=spec.moe_bias)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               spec.expert_activation or spec.activation, spec.moe_bias,
                               (cfg.swiglu_alpha, cfg.swiglu_limit))
        self.keep_router_logits = False
        self.router_logits: torch.Tensor | None = None
        self.router_experts: torch.Tensor | None = None  # [T, k] the experts the kept logits picked

    def forward(self, x: torch.Tensor, batch_invariant: bool = False,
                record: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = invariant_linear(flat, self.gate.weight, self.gate.bias) if batch_invariant else self.gate(flat)
        # the engine's forwards alone hand a recorder: in the default mode they take kernels (the router's, the
        # grouped GEMM's at decode sizes) that round otherwise than the trainer's forwards, which keep one rounding
        # with or without gradients (recomputed old logprobs meet the first update's); exact mode keeps one for all
        sampler = record is not None and not batch_invariant and not torch.is_grad_enabled()
        weights, experts = (route if sampler else route_reference)(logits, self.top_k, self.normalize)
        if self.keep_router_logits and torch.is_grad_enabled():
            self.router_logits, self.router_experts = logits, experts
        if record is not None:
            record(self.moe_index, experts)
        out = self.experts(flat, experts, weights.to(flat.dtype), batch_invariant, sampler)
        if self.has_shared:
            g = self.shared_expert_gate
            gate = invariant_linear(flat, g.weight) if batch_invariant else g(flat)
            out = out + torch.sigmoid(gate) * self.shared_expert(flat, batch_invariant)
        return out.view(shape)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor | None = None):
    """Switch Transformer's auxiliary loss over the layers' router logits ([T, E] each, the same T tokens): E times
    the sum over experts of (share of the tokens' top-k picks that went to the expert) x (its mean router
    probability), counting only tokens where `token_mask` [T] is true. transformers' `load_balancing_loss_func`
    (which TRL's `router_aux_loss_coef` weights) computes the same."""
    logits = torch.cat(router_logits)  # [L * T, E]
    e = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    picked = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, e).float()  # [L*T, k, E]
    if token_mask is None:
        share, mean_prob = picked.mean(0), probs.mean(0)
    else:
        m = token_mask.float().repeat(len(router_logits))
        share = (picked * m[:, None, None]).sum(0) / m.sum()
        mean_prob = (probs * m[:, None]).sum(0) / m.sum()
    return e * (share * mean_prob[None]).sum()


def expert_load_max(router_logits: list[torch.Tensor], top_k: int,
                    token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The busiest expert's share of a layer's top-k picks over the uniform share (1.0: balanced), the largest over
    the layers; a device scalar (no host synchronisation in the training loop)."""
    logits = torch.stack([x.detach() for x in router_logits])  # [L, T, E]
    if token_mask is not None:
        logits = logits[:, token_mask]
    e = logits.shape[-1]
    picks = F.one_hot(torch.topk(logits, top_k, dim=-1).indices, e).sum((1, 2)).float()  # [L, E]
    return (picks.amax(-1) * e / picks.sum(-1).clamp(min=1)).max()


def _expert_modules(model: nn.Module, prefix: str = "") -> list[tuple[str, Experts]]:
    return [(f"{prefix}{name}.", m) for name, m in model.named_modules() if isinstance(m, Experts)]


def join_expert_parts(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert weights (`experts.{e}.gate_proj.weight`, up, down) -> the stacked parameters;
    a checkpoint already stacked (`experts.gate_up_proj`) is unchanged. A missing expert is named."""
    state = dict(state)
    for p, m in _expert_modules(model):
        if f"{p}0.gate_proj.weight" not in state:
            continue
        names = [f"{p}{e}.{part}.weight" for e in range(m.num_experts)
                 for part in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"the weights have expert 0 of {p.rstrip('.')} but not {missing[:3]}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
        gate_up, down = [], []
        for e in range(m.num_experts):
            gate_up.append(torch.cat([state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")]))
            down.append(state.pop(f"{p}{e}.down_proj.weight"))
        state[f"{p}gate_up_proj"], state[f"{p}down_proj"] = torch.stack(gate_up), torch.stack(down)
    return state


def split_expert_parts(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The stacked expert parameters -> one module per expert, as checkpoints name them (views, no copies)."""
    state = dict(state)
    for p, m in _expert_modules(model):
        gate_up, down = state.pop(f"{p}gate_up_proj", None), state.pop(f"{p}down_proj", None)
        if gate_up is None:
            continue
        for e in range(m.num_experts):
            gate, up = gate_up[e].chunk(2)
            state[f"{p}{e}.gate_proj.weight"], state[f"{p}{e}.up_proj.weight"] = gate, up
            state[f"{p}{e}.down_proj.weight"] = down[e]
    return state
