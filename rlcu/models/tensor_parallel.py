"""Tensor parallelism (Megatron's layout) for rlcu's dense models: each rank of a tensor-parallel group holds
its share of every layer's heads and MLP columns, as plain parameters that the engine and training read in
place.

- q/k/v and gate/up (`FusedLinear`, column-parallel) keep, of each part, the rows of this rank's heads or
  columns: the fused GEMM stays one GEMM, on the rank's rows;
- o_proj and down_proj (row-parallel) keep the matching input columns; their partial outputs are summed
  over the group (one all-reduce per branch, two per layer), and their bias added once, after the sum;
- the embeddings and the LM head keep the rank's rows of the vocabulary (where the size divides it): lookups
  are summed over the group, logits gathered whole; norms are whole. So every rank computes the same hidden
  states and logits, samples the same tokens from the same seeds, and its engine schedules the same steps.

A column-parallel input's gradient is summed over the group in backward (the all-reduce's transpose), so
the whole parameters (norms) get the same gradient on every rank and stay equal without any extra
synchronisation. `model.config` becomes the rank's config (its head and column counts),
which is what the KV pool, the kernels and the reference cache size themselves by; the whole model's stays
in `model.tensor_parallel.config`. `full_state_dict` assembles the whole tensors (in the layout one process
has) for checkpoints and export; `load_state_dict` takes whole tensors and keeps the rank's share.

DTensor's ColwiseParallel would split a fused q/k/v weight into contiguous row blocks across the parts,
and rlcu's kernels read plain tensors: the split here is by part, on plain tensors."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlcu.models.config import ModelConfig


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """A model's tensor-parallel group: `size` ranks, this one `rank`; `config`: the whole model's."""

    group: object
    size: int
    rank: int
    config: ModelConfig

    @property
    def device(self) -> torch.device:
        """Where the group's collectives take their tensors: the GPU under NCCL (the model moves there after it is
        split, in Lightning's set-up), the CPU under gloo."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # what a strategy asks of a split model, without importing this module (`rlcu/strategies.py`)
    def full_state_dict(self, model: nn.Module, prefix: str = "", cpu: bool = False) -> dict[str, torch.Tensor]:
        return full_state_dict(model, prefix, cpu)

    def split_tensors(self, model: nn.Module) -> dict[str, tuple]:
        return split_tensors(model)

    def gather(self, share: torch.Tensor, style: tuple) -> torch.Tensor:
        return gather(share, style, self)

    def share(self, whole: torch.Tensor, style: tuple) -> torch.Tensor:
        return share(whole, style, self)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def agree(self, value: int) -> int:
        """The smallest of every rank's `value`: what ranks must decide alike (the engine's pool size)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


class _CopyIn(torch.autograd.Function):
    """Identity forward; backward sums the input's gradient over the group (a column-parallel layer's input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceOut(torch.autograd.Function):
    """Sums a row-parallel layer's partial outputs over the group; backward is the identity."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumEverywhere(_CopyIn):
    """Sums a partial over the group, for a result every rank uses on its own share: backward (_CopyIn's) sums
    the ranks' partial gradients the same way."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        t = t.contiguous()
        dist.all_reduce(t, group=group)
        return t


def split_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dim: int, tp: TensorParallel) -> torch.Tensor:
    """RMSNorm over a last dimension of `dim` whose columns are split across the group (OLMo's q/k norms over all
    heads): each rank's squares summed over the group, then its own columns scaled by its share of the weight,
    rounded as `rms_norm` rounds (`rlcu/kernels/rmsnorm.py`)."""
    squares = x.float().pow(2).sum(-1, keepdim=True)
    squares = _SumEverywhere.apply(squares, tp.group) if torch.is_grad_enabled() else tp.sum_(squares.contiguous())
    h = x.float() * torch.rsqrt(squares / dim + eps)
    return weight * h.to(x.dtype)


class _Gather(torch.autograd.Function):
    """Every rank's share joined along `dim`; backward keeps this rank's part of the gradient, which is whole and
    alike on every rank (they compute the same loss from the same joined tensor)."""

    @staticmethod
    def forward(ctx, t, dim, tp):
        ctx.dim, ctx.tp = dim, tp
        return _all_gather(t, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=ctx.dim)[ctx.tp.rank].contiguous(), None, None


def _all_gather(t: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    t = t.contiguous()
    shares = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(shares, t, group=tp.group)
    return torch.cat(shares, dim=dim)


def gather_last(y: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The ranks' logits over their rows of the vocabulary, joined into logits over all of it."""
    return _Gather.apply(y, -1, tp) if torch.is_grad_enabled() and y.requires_grad else _all_gather(y, -1, tp)


def gather_rows(w: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The whole of a weight split by rows (an LM head's vocabulary)."""
    return _Gather.apply(w, 0, tp) if torch.is_grad_enabled() and w.requires_grad else _all_gather(w, 0, tp)


def embed_share(ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Embeddings of `ids` from a table split by rows of the vocabulary: each rank looks up the ids in its rows
    (zeros for the others), and the ranks' lookups are summed."""
    start = tp.rank * weight.shape[0]
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    x = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * inside[..., None].to(weight.dtype)
    return reduce_out(x, tp)


def copy_in(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyIn.apply(x, tp.group) if torch.is_grad_enabled() and x.requires_grad else x


def reduce_out(y: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if torch.is_grad_enabled() and y.requires_grad:
        return _ReduceOut.apply(y, tp.group)
    y = y.contiguous()
    dist.all_reduce(y, group=tp.group)
    return y


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's share; an error that says which size does not divide."""
    why = tensor_parallel_refusal(cfg)
    if why:
        raise ValueError(f"tensor parallelism: {why}; use tensor_parallel_size=1 (FSDP or DDP) for this model")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, name) % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name} "
                             f"({getattr(cfg, name)}): choose a tensor_parallel_size that does")
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                   num_key_value_heads=cfg.num_key_value_heads // size,
                   intermediate_size=cfg.intermediate_size // size)


def tensor_parallel_refusal(cfg: ModelConfig) -> str | None:
    """Why a model cannot be split by heads and MLP columns here, or None."""
    if cfg.is_moe:
        return f"{cfg.model_type}'s experts are not split across ranks (shard a mixture of experts with FSDP)"
    if cfg.linear_layers:
        return f"{cfg.model_type}'s linear-attention layers are not split across ranks"
    if cfg.spec.attention_sinks:
        return f"{cfg.model_type}'s attention sinks are not split across ranks"
    return None


def _split_rows(w: torch.Tensor, parts: dict[str, int], size: int, rank: int) -> torch.Tensor:
    return torch.cat([p.chunk(size)[rank] for p in w.split(list(parts.values()))])


def _join_rows(shares: list[torch.Tensor], parts: dict[str, int]) -> torch.Tensor:
    """The whole fused tensor from every rank's share (each rank's rows: its slice of each part, in order)."""
    local = list(parts.values())
    per_rank = [s.split(local) for s in shares]
    return torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(len(local))])


def _modules(model: nn.Module):
    """(module, style) of each projection that tensor parallelism splits."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield from ((attn.qkv_proj, "column"), (attn.o_proj, "row"), (mlp.gate_up_proj, "column"),
                    (mlp.down_proj, "row"))


def parallelize(model: nn.Module, group, size: int | None = None, rank: int | None = None) -> nn.Module:
    """Keeps this rank's share of `model` (a whole one, on every rank alike) in place; returns it."""
    size = dist.get_world_size(group) if size is None else size
    rank = dist.get_rank(group) if rank is None else rank
    if getattr(model, "tensor_parallel", None) is not None or size == 1:
        return model
    full = model.config
    local = rank_config(full, size)
    if any(m.lora is not None for m, _ in _modules(model)):
        raise ValueError("tensor parallelism with LoRA adapters is not built: use tensor_parallel_size=1 for a "
                         "LoRA run")
    tp = TensorParallel(group, size, rank, full)
    with torch.no_grad():
        for m, style in _modules(model):
            if style == "column":
                m.weight = nn.Parameter(_split_rows(m.weight, m.parts, size, rank))
                if m.bias is not None:
                    m.bias = nn.Parameter(_split_rows(m.bias, m.parts, size, rank))
                m.parts = {k: v // size for k, v in m.parts.items()}
            else:
                m.weight = nn.Parameter(m.weight.chunk(size, dim=1)[rank].contiguous())
            m.in_features, m.out_features = m.weight.shape[1], m.weight.shape[0]
            m.tensor_parallel, m.parallel_style = tp, style
        _split_attention(model, local, tp)
        if full.vocab_size % size == 0:  # the embeddings and LM head by rows of the vocabulary (else whole)
            embed, head = model.model.embed_tokens, model.lm_head
            embed.weight = nn.Parameter(embed.weight.chunk(size)[rank].clone())
            head.weight = embed.weight if full.tie_word_embeddings else nn.Parameter(
                head.weight.chunk(size)[rank].clone())
            for m in (embed, head):
                m.tensor_parallel, m.parallel_style = tp, "vocab"
    model.config, model.tensor_parallel = local, tp
    model.register_load_state_dict_pre_hook(_keep_share)
    return model


def _split_attention(model: nn.Module, local: ModelConfig, tp: TensorParallel) -> None:
    """Each attention module computes the rank's heads; its q/k norms follow how they normalise."""
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        if attn.qk_norm == "head":  # per head: whole on every rank, applied to the rank's heads
            attn.q_norm.tensor_parallel = attn.k_norm.tensor_parallel = tp
        elif attn.qk_norm == "full":  # over all heads (OLMo): each rank keeps its heads' columns of the weight
            for norm in (attn.q_norm, attn.k_norm):
                norm.split_dim, norm.tensor_parallel = norm.weight.numel(), tp
                norm.weight = nn.Parameter(norm.weight.chunk(tp.size)[tp.rank].clone())


def split_tensors(model: nn.Module) -> dict[str, tuple[str, dict[str, int] | None]]:
    """State-dict keys of a model's shares -> how they are split: ("column", the rank's part sizes), ("row", None),
    or by rows: ("vocab", None), ("heads", None)."""
    out = {}
    for name, m in model.named_modules():
        style = getattr(m, "parallel_style", None)
        if style:
            out[f"{name}.weight"] = (style, m.parts if style == "column" else None)
            if style == "column" and m.bias is not None:
                out[f"{name}.bias"] = (style, m.parts)
        elif getattr(m, "split_dim", None):
            out[f"{name}.weight"] = ("heads", None)
    return out


def gather(share: torch.Tensor, style: tuple, tp: TensorParallel) -> torch.Tensor:
    """The whole tensor from every rank's `share` (a collective), in the layout one process has."""
    kind, parts = style
    share = share.to(tp.device).contiguous()
    shares = [torch.empty_like(share) for _ in range(tp.size)]
    dist.all_gather(shares, share, group=tp.group)
    return _join_rows(shares, parts) if kind == "column" else torch.cat(shares, dim=1 if kind == "row" else 0)


def share(whole: torch.Tensor, style: tuple, tp: TensorParallel) -> torch.Tensor:
    """This rank's share of a whole tensor."""
    kind, parts = style
    if kind == "column":
        return _split_rows(whole, {k: v * tp.size for k, v in parts.items()}, tp.size, tp.rank)
    return whole.chunk(tp.size, dim=1 if kind == "row" else 0)[tp.rank].contiguous()


def _keep_share(module, state, prefix, *args) -> None:
    """load_state_dict's pre-hook: a whole tensor (the size one process has) becomes this rank's share."""
    params = dict(module.named_parameters(remove_duplicate=False))  # a tied LM head under its own name too
    for key, style in split_tensors(module).items():
        value = state.get(prefix + key)
        if value is not None and value.shape != params[key].shape:
            state[prefix + key] = share(value, style, module.tensor_parallel)


def full_state_dict(model: nn.Module, prefix: str = "", cpu: bool = False) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each share whole again (a collective: every rank of the group calls it); `cpu`:
    each whole tensor moved to host memory as soon as it is assembled (a model that fits the GPU only split)."""
    state = model.state_dict(prefix=prefix)
    tp = getattr(model, "tensor_parallel", None)
    if tp is None:
        return state
    for key, style in split_tensors(model).items():
        whole = gather(state[prefix + key], style, tp)
        state[prefix + key] = whole.cpu() if cpu else whole
    return state


def grad_norm(params: list[torch.Tensor], split: list[bool], tp: TensorParallel) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, on every rank alike. `split[i]`: params[i] is a share, whose
    squares are summed over the group; the others are whole on every rank of it and count once. Under FSDP beside
    it (DTensor gradients), each rank's shard's squares are first summed over the data-parallel ranks."""
    squares, dp_group = [], None
    for p, is_share in zip(params, split):
        if p.grad is not None:
            g = p.grad
            if hasattr(g, "to_local"):
                dp_group, g = g.device_mesh.get_group(), g.to_local()
            squares.append((torch.linalg.vector_norm(g, dtype=torch.float32) ** 2, is_share))
    device = squares[0][0].device
    total = torch.zeros(2, device=device)  # the whole tensors', the shares'
    for sq, is_share in squares:
        total[int(is_share)] += sq
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return (total[0] + tp.sum_(total[1:])[0]).sqrt()


def split_parameters(model: nn.Module, params: list[torch.Tensor]) -> list[bool] | None:
    """Which of `params` are shares of a tensor-parallel `model` (None: the model is not split)."""
    tp = getattr(model, "tensor_parallel", None)
    if tp is None:
        return None
    shares = {id(p) for name, p in model.named_parameters() if name in split_tensors(model)}
    return [id(p) in shares for p in params]
