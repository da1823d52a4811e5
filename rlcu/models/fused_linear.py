"""Several projections of the same input as one GEMM (q/k/v, gate/up), stored as one parameter.

One weight `[sum(sizes), in]` instead of three or two halves the launches of a decode step and gives
training larger GEMMs. Inside rlcu (parameters, optimizer state, Lightning checkpoints, FSDP shards)
the fused names are the names; Hugging Face folders name the parts, so `load_model` joins them with
`join_hf_parts` and `save_pretrained` splits them with `split_hf_parts`."""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from rlcu.kernels.matmul import invariant_linear
from rlcu.models.tensor_parallel import TensorParallel, copy_in, gather_last, gather_rows, reduce_out


class Linear(nn.Linear):
    """`nn.Linear` whose caller may ask for batch-invariant GEMMs (`Numerics.EXACT`, passed down with the forward's
    attention context), so that a row computes to the same bits in the engine's decode batches and in training
    micro-batches. `fp32` (the LM head under TRL's `cast_lm_head_to_fp32`): the GEMM runs in float32 whatever the
    autocast or the input's dtype, and gives float32. `softcap` (an LM head's, Gemma 2's
    `final_logit_softcapping`): the outputs bounded as cap * tanh(y / cap), in their own dtype as transformers
    computes them (`soft_capped`). `tensor_parallel` and `parallel_style` ("column" | "row" for a projection,
    "vocab" for an LM head): set on a rank's share of the weight (`tensor_parallel.py`); an LM head's share gives
    its rows of the vocabulary, and the ranks' logits are gathered whole."""

    fp32 = False
    softcap: float | None = None
    tensor_parallel: TensorParallel | None = None
    parallel_style: str | None = None

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        tp = self.tensor_parallel
        if tp is None:
            return soft_capped(self._linear(x, batch_invariant), self.softcap)
        return soft_capped(gather_last(self._linear(copy_in(x, tp), batch_invariant), tp), self.softcap)

    def full_weight(self) -> torch.Tensor:
        """The whole weight: gathered from the ranks' shares under tensor parallelism (training's chunked logprobs
        read it; its gradient goes back to each rank's share)."""
        return self.weight if self.tensor_parallel is None else gather_rows(self.weight, self.tensor_parallel)

    def _linear(self, x: torch.Tensor, batch_invariant: bool, with_bias: bool = True) -> torch.Tensor:
        if not with_bias and self.bias is not None:
            return invariant_linear(x, self.weight, None) if batch_invariant else F.linear(x, self.weight)
        if self.fp32:
            with torch.autocast(x.device.type, enabled=False):
                bias = None if self.bias is None else self.bias.float()
                x, weight = x.float(), self.weight.float()
                return invariant_linear(x, weight, bias) if batch_invariant else F.linear(x, weight, bias)
        if batch_invariant:
            return invariant_linear(x, self.weight, self.bias)
        return super().forward(x)


def soft_capped(y: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(y / cap), or y where there is no cap."""
    return y if cap is None else torch.tanh(y / cap) * cap


class FusedLinear(Linear):
    """`parts` maps each HF projection name (a sibling of this module in HF's layout) to its output size; a
    projection of one part (o_proj, down_proj) has its own name as its part. `lora`: an optional low-rank
    adapter (`rlcu/models/lora.py`) added to the output, never merged into the weight."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        tp, row = self.tensor_parallel, self.parallel_style == "row"
        if tp is not None and not row:
            x = copy_in(x, tp)
        lora, with_bias = self.lora if self.lora is not None and self.lora.enabled else None, tp is None or not row
        if lora is not None and batch_invariant:
            y = lora.invariant_linear(x, self.weight, self.bias if with_bias else None)
        else:
            y = self._linear(x, batch_invariant, with_bias=with_bias)
            y = y if lora is None else lora.add_to(y, x)
        if tp is not None and row:  # the partial sums of the rank's input columns; the bias once, after
            y = reduce_out(y, tp)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
        return y

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The output of each part, as views of the fused output."""
        return y.split(list(self.parts.values()), dim=-1)


def _fused_modules(model: nn.Module, prefix: str) -> list[tuple[str, str, FusedLinear]]:
    """(state-dict prefix of the fused module, prefix of its HF siblings, module) for each FusedLinear."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FusedLinear):
            parent = name.rpartition(".")[0]
            out.append((f"{prefix}{name}.", f"{prefix}{parent}." if parent else prefix, m))
    return out


def split_hf_parts(state: dict[str, torch.Tensor], model: nn.Module, prefix: str = "",
                   keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A state dict with fused names -> the same with HF's part names (views of the fused tensors). `keep`: the
    fused modules (by their own name) that the checkpoint format stores fused too (Phi-3's `qkv_proj`)."""
    state = dict(state)
    for fused, parent, m in _fused_modules(model, prefix):
        if fused[len(parent):-1] in keep:
            continue
        for kind in ("weight", "bias"):
            value = state.pop(fused + kind, None)
            if value is not None:
                for part, piece in zip(m.parts, value.split(list(m.parts.values()), dim=0)):
                    state[f"{parent}{part}.{kind}"] = piece
    return state


def join_hf_parts(state: dict[str, torch.Tensor], model: nn.Module, prefix: str = "",
                  join=functools.partial(torch.cat, dim=0)) -> dict[str, torch.Tensor]:
    """A state dict with HF's part names (or already fused: unchanged) -> fused names. Some parts of a
    projection without the others is an error that names the missing ones. `join`: how the parts (a list) become
    one value (tensors: concatenated rows; `loading.py` joins tensors not read yet)."""
    state = dict(state)
    for fused, parent, m in _fused_modules(model, prefix):
        for kind in ("weight", "bias"):
            keys = [f"{parent}{part}.{kind}" for part in m.parts]
            present = [k for k in keys if k in state]
            if not present:
                continue  # already fused, or absent: the caller's missing-key check reports it
            if len(present) < len(keys):
                raise ValueError(f"the weights have {present} but not {sorted(set(keys) - set(present))}")
            parts = [state.pop(k) for k in keys]
            state[fused + kind] = parts[0] if len(parts) == 1 else join(parts)  # one part: no copy
    return state
