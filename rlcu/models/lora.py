"""LoRA inside rlcu's own models: each targeted projection gets a low-rank update y += (B A x) * alpha / r,
computed beside the frozen base weight and never merged, so training, the reference rollout and the
paged engine all run base + adapter through the same modules, and the engine's next rollout uses the
adapters the optimizer just stepped (no merge, copy or sync).

Options follow PEFT's `LoraConfig` (`r`, `lora_alpha`, `lora_dropout`, `target_modules`, `bias="none"`,
`use_rslora`); a PEFT `LoraConfig` object is accepted as is (TRL's `peft_config`). Adapters are saved in
PEFT's format (`adapter_config.json`, `adapter_model.safetensors`), which `PeftModel.from_pretrained`
loads onto the transformers model.

A fused projection (q/k/v, gate/up) holds one adapter per targeted part: A stacked as [parts * r, in]
(one GEMM), B as [sum of the parts' outputs, r] whose row block i multiplies part i's slice of A x.

A mixture of experts' stacked projections take PEFT's `target_parameters` ("mlp.experts.gate_up_proj",
"mlp.experts.down_proj"): one adapter per expert, A [E, r, in] and B [E, out, r], run as grouped GEMMs over the
tokens sorted by expert, as the base weights are (`ExpertAdapter`); saved as PEFT's ParamWrapper saves them."""
from __future__ import annotations

import contextlib
import json
import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rlcu.kernels.matmul import LowRank, invariant_linear
from rlcu.models.fused_linear import FusedLinear
from rlcu.models.moe import Experts, grouped_linear, vendor_grouped

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # Experts' stacked projections, PEFT's target_parameters
# the adapters `lora_disabled` turned off, per thread: the engine may decode on the adapters in one thread while
# the KL reference runs without them in another (streaming's decode_steps_during_training)
_OFF = threading.local()


class Switch:
    """An adapter's `enabled`: on, unless `lora_disabled` turned it off in the calling thread."""

    @property
    def enabled(self) -> bool:
        return id(self) not in getattr(_OFF, "ids", ())


@dataclass
class LoraSpec:
    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "v_proj"])
    bias: str = "none"
    use_rslora: bool = False
    target_parameters: list[str] | None = None

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"LoRA r must be >= 1, got {self.r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.bias != "none":
            raise ValueError(f"LoRA bias={self.bias!r} is not supported; rlcu trains adapters with bias='none'")
        targets = ALL_LINEAR if self.target_modules in ("all-linear", "all_linear") else self.target_modules
        if isinstance(targets, str):
            targets = [targets]
        unknown = sorted(set(targets) - set(ALL_LINEAR))
        if unknown:
            raise ValueError(f"unknown LoRA target_modules {unknown}; rlcu's models have {list(ALL_LINEAR)} "
                             "(or 'all-linear')")
        self.target_modules = [t for t in ALL_LINEAR if t in targets]
        if self.target_parameters:
            params = [self.target_parameters] if isinstance(self.target_parameters, str) else self.target_parameters
            unknown = [t for t in params if not t.endswith(tuple(f"experts.{p}" for p in EXPERT_PARAMETERS))]
            if unknown:
                raise ValueError(f"unknown LoRA target_parameters {unknown}; rlcu adapts the experts' stacked "
                                 "projections: 'mlp.experts.gate_up_proj', 'mlp.experts.down_proj'")
            if self.lora_dropout:
                raise ValueError("LoRA on experts (target_parameters) takes no lora_dropout (nor does PEFT's): set "
                                 "lora_dropout: 0")
            self.target_parameters = [f"mlp.experts.{p}" for p in EXPERT_PARAMETERS
                                      if any(t.endswith(f"experts.{p}") for t in params)]

    @property
    def expert_parts(self) -> list[str]:
        """The Experts parameters that carry an adapter ("gate_up_proj", "down_proj")."""
        return [t.rpartition(".")[2] for t in self.target_parameters or []]

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def of(cls, config) -> "LoraSpec":
        """From a LoraSpec, a mapping of its fields, or a PEFT `LoraConfig` (read by attribute)."""
        if isinstance(config, LoraSpec):
            return config
        names = [f for f in cls.__dataclass_fields__]
        if isinstance(config, dict):
            unknown = sorted(set(config) - set(names) - {"task_type", "peft_type"})
            if unknown:
                raise ValueError(f"unknown LoRA option(s) {unknown}; options: {names}")
            return cls(**{k: v for k, v in config.items() if k in names})
        if type(config).__name__ == "LoraConfig":
            values = {n: getattr(config, n) for n in names if hasattr(config, n)}
            if isinstance(values.get("target_modules"), set):
                values["target_modules"] = sorted(values["target_modules"])
            if values.get("target_modules") is None:
                values["target_modules"] = ["q_proj", "v_proj"]  # PEFT's default for Llama-family models
            return cls(**values)
        raise TypeError(f"a LoRA config is a LoraConfig, a mapping or a LoraSpec, got {type(config).__name__}")


class LoraAdapter(Switch, nn.Module):
    """The low-rank update of one (fused) projection, for the parts in `targets`."""

    def __init__(self, base: FusedLinear, spec: LoraSpec, targets: list[str]):
        super().__init__()
        self.targets, self.scaling, self.r = targets, spec.scaling, spec.r
        self.part_sizes = dict(base.parts)
        out = sum(self.part_sizes[t] for t in targets)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(len(targets) * spec.r, base.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(out, spec.r, **kw))  # zero: the model starts as the base
        for i in range(len(targets)):  # as PEFT initialises each part's A
            nn.init.kaiming_uniform_(self.lora_A[i * spec.r:(i + 1) * spec.r], a=math.sqrt(5))
        self.dropout = nn.Dropout(spec.lora_dropout) if spec.lora_dropout > 0 else nn.Identity()
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y + (B A x) * scaling for the whole fused output y: one GEMM into A x, then the update of each
        part. A projection of one part adds B's GEMM into y directly. For several parts, with gradients
        recorded: one GEMM with a block-diagonal B (untargeted parts' rows of it are zero), assembled
        at each call; without (the engine's forward, at every decode step): one in-place GEMM per part into
        its columns of y, which this call owns, so nothing is assembled or copied."""
        h = F.linear(self.dropout(x), self.lora_A).reshape(-1, self.lora_A.shape[0])
        y2 = y.reshape(-1, y.shape[-1])
        if len(self.part_sizes) == 1:
            return torch.addmm(y2, h, self.lora_B.t(), alpha=self.scaling).view(y.shape)
        if torch.is_grad_enabled():
            return torch.addmm(y2, h, self.block_diagonal_b().t(), alpha=self.scaling).view(y.shape)
        h, b = h.to(y.dtype), self.lora_B.to(y.dtype)  # autocast leaves in-place GEMMs alone: fp32 B, bf16 y
        for start, size, slot, row in self._targeted_parts():
            y2[:, start:start + size].addmm_(h[:, slot * self.r:(slot + 1) * self.r], b[row:row + size].t(),
                                             alpha=self.scaling)
        return y

    def invariant_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) + (B A x) * scaling with batch-invariant rows (exact_logprobs): A's GEMM, then the base
        GEMM with B's update in the same launch (`LowRank`: B block-diagonal over the parts, read through the
        column maps, never assembled); one computation whether the engine decodes or training records
        gradients, so a row rounds alike in both."""
        h = invariant_linear(x, self.lora_A)
        return invariant_linear(x, weight, bias, LowRank(h, self.lora_B, self.scaling, *self.column_maps(x.device)))

    def column_maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`LowRank`'s maps of the block-diagonal B over the fused output's columns (int32: B's row, or -1 where the
        part is not adapted; the column of A x where that row's part starts), made once a device from the part
        sizes alone (a model built on the meta device and given memory later has them right). The first exact
        forward on a device is eager (a prefill, a training forward), never inside a CUDA graph's capture."""
        maps = self._maps.get(device)
        if maps is None:
            out = sum(self.part_sizes.values())
            rows, firsts = torch.full((out,), -1, dtype=torch.int32), torch.zeros(out, dtype=torch.int32)
            for start, size, slot, row in self._targeted_parts():
                rows[start:start + size] = torch.arange(row, row + size, dtype=torch.int32)
                firsts[start:start + size] = slot * self.r
            maps = self._maps[device] = (rows.to(device), firsts.to(device))
        return maps

    def _targeted_parts(self) -> list[tuple[int, int, int, int]]:
        """(first column in the fused output, size, slot in A, first row in B) of each targeted part."""
        parts, start, row, slot = [], 0, 0, 0
        for part, size in self.part_sizes.items():
            if part in self.targets:
                parts.append((start, size, slot, row))
                row, slot = row + size, slot + 1
            start += size
        return parts

    def block_diagonal_b(self) -> torch.Tensor:
        """[fused output, parts * r]: part i's rows of B in its own column block."""
        b = self.lora_B.new_zeros(sum(self.part_sizes.values()), self.lora_A.shape[0])
        for start, size, slot, row in self._targeted_parts():
            b[start:start + size, slot * self.r:(slot + 1) * self.r] = self.lora_B[row:row + size]
        return b

    def delta_weight(self) -> torch.Tensor:
        """B A * scaling as a [out, in] weight update of the fused projection (for merging)."""
        delta = self.lora_A.new_zeros(sum(self.part_sizes.values()), self.lora_A.shape[1])
        for start, size, slot, row in self._targeted_parts():
            delta[start:start + size] = self.lora_B[row:row + size] @ self.lora_A[slot * self.r:(slot + 1) * self.r]
        return delta * self.scaling


class ExpertAdapter(Switch, nn.Module):
    """LoRA on one stacked expert projection (weight [E, out, in]): expert e computes x (W_e + B_e A_e scaling)^T,
    A [E, r, in], B [E, out, r], initialised as PEFT's ParamWrapper initialises its [r E, in] and [out, r E]."""

    def __init__(self, weight: torch.Tensor, spec: LoraSpec):
        super().__init__()
        e, out, inp = weight.shape
        kw = dict(device=weight.device, dtype=weight.dtype)
        self.r, self.scaling = spec.r, spec.scaling
        self.lora_A = nn.Parameter(torch.empty(e, spec.r, inp, **kw))
        self.lora_B = nn.Parameter(torch.zeros(e, out, spec.r, **kw))
        nn.init.kaiming_uniform_(self.lora_A.view(e * spec.r, inp), a=math.sqrt(5))

    def add_to(self, y: torch.Tensor, rows: torch.Tensor, counts, batch_invariant: bool = False,
               sampler: bool = False) -> torch.Tensor:
        """y [M, out] + the update of `rows` [M, in], sorted by expert (`counts` rows each), as `grouped_linear`."""
        a, b = self.lora_A, self.lora_B
        if not isinstance(counts, list) and vendor_grouped(rows, a.shape[0], batch_invariant, sampler) and self.r % 8:
            # torch's grouped GEMM takes rows of whole 16-byte units: zero rank rows and columns change nothing
            pad = 8 - self.r % 8
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
        h = grouped_linear(rows, a, counts, batch_invariant, sampler)
        return y + grouped_linear(h, b, counts, batch_invariant, sampler) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        return torch.bmm(self.lora_B, self.lora_A) * self.scaling


def expert_adapters(model: nn.Module) -> list[tuple[str, Experts]]:
    """(module name, Experts) of every experts module that carries adapters."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Experts) and m.lora is not None]


def adapters(model: nn.Module) -> list[tuple[str, FusedLinear]]:
    """(module name, projection) of every projection that carries an adapter."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedLinear) and m.lora is not None]


def add_lora(model: nn.Module, config) -> LoraSpec:
    """Freeze every base parameter and give each targeted projection an adapter; returns the spec."""
    spec = LoraSpec.of(config)
    if adapters(model):
        raise ValueError("this model already has LoRA adapters")
    model.requires_grad_(False)
    for _, m in list(model.named_modules()):
        if isinstance(m, FusedLinear):
            targets = [p for p in m.parts if p in spec.target_modules]
            if targets:
                m.lora = LoraAdapter(m, spec, targets)
        elif isinstance(m, Experts) and spec.expert_parts:
            m.lora = nn.ModuleDict({p: ExpertAdapter(getattr(m, p), spec) for p in spec.expert_parts})
    if spec.expert_parts and not expert_adapters(model):
        raise ValueError(f"LoRA target_parameters {spec.target_parameters}: this model has no experts; leave "
                         "target_parameters unset")
    model.lora_spec = spec
    return spec


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """The base model: every adapter off while the block runs (a KL reference without a second copy), in the
    calling thread only."""
    found = [m.lora for _, m in adapters(model)] + [a for _, m in expert_adapters(model) for a in m.lora.values()]
    before = getattr(_OFF, "ids", frozenset())
    _OFF.ids = before | {id(lora) for lora in found}
    try:
        yield model
    finally:
        _OFF.ids = before


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight and remove it (for export)."""
    with torch.no_grad():
        for _, m in adapters(model):
            m.weight += m.lora.delta_weight().to(m.weight.dtype)
            m.lora = None
        for _, m in expert_adapters(model):
            for part, lora in m.lora.items():
                getattr(m, part).add_(lora.delta_weight().to(getattr(m, part).dtype))
            m.lora = None
    if hasattr(model, "lora_spec"):
        del model.lora_spec


def peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names: base_model.model.<HF module path>.lora_A.weight / lora_B.weight."""
    state = {}
    for name, m in adapters(model):
        parent = name.rpartition(".")[0]
        lora, row = m.lora, 0
        for slot, part in enumerate(lora.targets):
            size = lora.part_sizes[part]
            hf = f"base_model.model.{parent}.{part}"  # a one-part projection's part is its own name
            state[f"{hf}.lora_A.weight"] = lora.lora_A[slot * lora.r:(slot + 1) * lora.r].detach().contiguous().cpu()
            state[f"{hf}.lora_B.weight"] = lora.lora_B[row:row + size].detach().contiguous().cpu()
            row += size
    return state | _peft_expert_state(model)


def _peft_expert_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's ParamWrapper names: with both projections targeted, gate_up_proj's wrapper is the inner one
    (`experts.base_layer.lora_A.weight`) and down_proj's the outer (`experts.lora_A.weight`). lora_A [r E, in]
    expert-major; lora_B [out, r E] expert-minor (PEFT reshapes it [out, r, E]). Out rows in the checkpoint's order
    (gpt-oss interleaves gate and up: the spec's `experts_interleaved`)."""
    state, found = {}, expert_adapters(model)
    spec = model.config.spec if found else None
    for name, m in found:
        parts = list(m.lora)
        for part, lora in m.lora.items():
            key = f"{name}.{part}"
            if spec.save_weights is not None and key not in spec.save_weights({key: getattr(m, part)}, model.config):
                raise ValueError(f"{model.config.model_type}'s checkpoints name the experts' {part} otherwise, so PEFT "
                                 "would not find these adapters: merge them into the weights instead "
                                 "(`rlcu export CKPT DIR --merge`)")
            inner = ".base_layer" if len(parts) == 2 and part == "gate_up_proj" else ""
            prefix = f"base_model.model.{name}{inner}"
            a, b = lora.lora_A.detach(), lora.lora_B.detach()
            if spec.experts_interleaved and part == "gate_up_proj":
                b = torch.stack(b.chunk(2, dim=1), dim=2).flatten(1, 2)  # gate half, up half -> alternating rows
            state[f"{prefix}.lora_A.weight"] = a.flatten(0, 1).contiguous().cpu()
            state[f"{prefix}.lora_B.weight"] = b.permute(1, 2, 0).flatten(1).contiguous().cpu()
    return state


def save_adapter(model: nn.Module, folder: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters as PEFT does: `adapter_config.json` and `adapter_model.safetensors`."""
    from safetensors.torch import save_file

    spec: LoraSpec = getattr(model, "lora_spec", None)
    if spec is None:
        raise ValueError("this model has no LoRA adapters to save")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(peft_state_dict(model), folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = dict(asdict(spec), peft_type="LORA", task_type="CAUSAL_LM", inference_mode=True, fan_in_fan_out=False,
                  base_model_name_or_path=base_model_name_or_path, modules_to_save=None, init_lora_weights=True)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
