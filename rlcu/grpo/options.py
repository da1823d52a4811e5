"""GRPOModule's options, each defined once: its name (TRL's where TRL has the option), default, help and
validation, in a frozen dataclass group that checks itself when it is built. `Options.from_flat` is the one
adapter from the flat names users write (Python keywords, YAML under `model:`, `--model.key=value`) to the
groups; GRPOModule's signature, `--help` and `--print_config` are generated from the same definitions."""
from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from rlcu.agents.formats import FORMATS as TOOL_FORMATS
from rlcu.agents.programs import HISTORIES as AGENT_HISTORIES
from rlcu.agents.tools import MAX_RESULT_CHARS
from rlcu.agents.workers import AUTO as AUTO_PROCESSES
from rlcu.calls import ISOLATION
from rlcu.contracts import SamplingParams
from rlcu.grpo import registry
from rlcu.grpo.optim import OFFLOAD_WITHOUT_MASTERS

log = logging.getLogger(__name__)

SCALES = ("group", "batch", "none")
LEVELS = ("token", "sequence")
SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# transformers' schedules by TRL's names (`get_scheduler`), with their meanings: "constant" takes no warm-up
SCHEDULES = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ADAM_STATE_DTYPES = ("float32", "bfloat16")
ON_REWARD_ERROR = ("raise", "none")


def option(default: Any, help: str, *, choices: tuple | None = None, minimum: float | None = None,
           maximum: float | None = None, why: str = "", alias_of: str | None = None):
    """One option: its default and help, the values it takes, and (`alias_of`) the option it is another name
    for (rlcu's neutral name of a TRL option, or TRL's name of an rlcu one)."""
    meta = dict(help=help, choices=choices, minimum=minimum, maximum=maximum, why=why, alias_of=alias_of)
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class OptionGroup:
    """A group validates each field against its declared choices and bounds, then its own rules (`check`)."""
    title: ClassVar[str] = ""

    def __post_init__(self):
        hints = _hints(type(self))
        for f in fields(self):
            value = _typed(f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
            meta = f.metadata
            if meta["choices"] is not None and value not in meta["choices"]:
                raise ValueError(f"{f.name} must be one of {meta['choices']}, got {value!r}")
            low, high = meta["minimum"], meta["maximum"]
            if value is not None and low is not None and value < low:
                raise ValueError(f"{f.name} must be >= {low}{meta['why']}, got {value}")
            if value is not None and high is not None and value > high:
                raise ValueError(f"{f.name} must be <= {high}{meta['why']}, got {value}")
        self.check()

    def check(self) -> None:
        """Rules across fields."""


@functools.cache
def _hints(group: type) -> dict[str, Any]:
    return typing.get_type_hints(group)


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def _is(value: Any, kind: type) -> bool:
    """numpy's scalars count as numbers (a sweep may hand them over); a bool is no number."""
    if kind is bool or isinstance(value, bool):
        return isinstance(value, bool) and kind is bool
    number = {int: numbers.Integral, float: numbers.Real}.get(kind)
    return isinstance(value, number or kind)


def _typed(name: str, value: Any, hint: Any) -> Any:
    """`value` checked against the option's type: a float option takes an int, and a number written as text (YAML
    1.1 reads `1e-5` as text, as TRL's configs meet it); any other mismatch, and NaN, is one line naming the option,
    where a bound's comparison raised a TypeError naming none (or let NaN through). Types other than scalars and
    their unions with None pass as given."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in kinds:
        return value
    scalars = [k for k in kinds if k is not type(None)]
    if not scalars or any(k not in _SCALARS for k in scalars):
        return value
    if float in scalars and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if any(_is(value, k) for k in scalars):
        if value != value:  # NaN passes every bound's comparison
            raise ValueError(f"{name} is NaN: give a number")
        return value
    wanted = " or ".join(_SCALARS[k] for k in scalars) + (" or null" if type(None) in kinds else "")
    raise ValueError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class SamplingOptions(OptionGroup):
    title: ClassVar[str] = "sampling"
    num_generations: int = option(8, "completions per prompt (the group)", minimum=2,
                                  why=" (GRPO compares completions within a group)")
    max_prompt_length: int = option(512, "prompt tokens at most; a longer prompt is an error naming the sample "
                                         "(or keeps its end: long_prompts)", minimum=1)
    max_completion_length: int = option(512, "completion tokens at most", minimum=1)
    temperature: float = option(1.0, "sampling temperature (> 0: the loss's logprobs are of logits / temperature; "
                                     "held-out evaluation is greedy by itself)")
    top_p: float = option(1.0, "nucleus sampling's probability mass", minimum=1e-9, maximum=1)
    top_k: int = option(0, "sample among the k likeliest tokens (0: off)", minimum=0)
    min_p: float | None = option(None, "drop tokens below min_p times the likeliest's probability (None or 0: off)",
                                 minimum=0, maximum=1)
    repetition_penalty: float = option(1.0, "TRL's (vLLM's meaning): > 1 discourages tokens already in the prompt or "
                                            "completion, < 1 encourages them (1.0: off)", minimum=1e-9)
    stop: list[str] | None = option(None, "stop strings; completions also stop at every EOS id of the model and "
                                          "tokenizer")
    chat_template_kwargs: dict | None = option(None, "extra arguments of the tokenizer's chat template for chat "
                                                     "prompts (TRL's), e.g. {enable_thinking: false}")
    long_prompts: str = option("error", "a prompt over max_prompt_length: stop at set-up (error), or keep its end "
                                        "(truncate_left)", choices=("error", "truncate_left"))
    seed: int = option(42, "seeds the sampler (with the step and the rank)")

    def check(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}: GRPO learns from the differences "
                             "between a group's sampled completions (greedy ones are all alike) and its logprobs "
                             "divide the logits by it; TRL's default is 1.0")

    def params(self, stop_token_ids: list[int], seed: int | None = None, greedy: bool = False) -> SamplingParams:
        """The sampler's settings (greedy: temperature 0, for evaluation)."""
        return SamplingParams(max_tokens=self.max_completion_length, temperature=0.0 if greedy else self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_p=self.min_p or 0.0,
                              stop_token_ids=stop_token_ids, stop=list(self.stop or []), seed=seed,
                              repetition_penalty=self.repetition_penalty)


@dataclass(frozen=True)
class LossOptions(OptionGroup):
    """The policy loss, its advantages, and the settings of TRL 1.16's newer losses (TRL's names, defaults)."""
    title: ClassVar[str] = "loss"
    loss_type: str = option("dapo", "grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo, or a plugin's "
                                    "(rlcu.losses)")
    advantage_estimator: str = option("grpo", "grpo (group normalisation) | rloo | reinforce_pp, or a plugin's "
                                              "(rlcu.losses)")
    scale_rewards: str | bool = option("group", "advantages divided by the group's std, the batch's, or none (Dr. "
                                                "GRPO); TRL's booleans: true is group, false none",
                                       choices=(*SCALES, True, False))
    multi_objective_aggregation: str = option("sum_then_normalize", "several rewards: weighted sum, then the "
                                                                    "advantage (sum_then_normalize), or each reward "
                                                                    "normalised in its group first, then summed and "
                                                                    "normalised over the batch (normalize_then_sum)",
                                              choices=AGGREGATIONS)
    importance_sampling_level: str = option("token", "token, or sequence (GSPO)", choices=LEVELS)
    epsilon: float = option(0.2, "clip range", minimum=0)
    epsilon_high: float | None = option(None, "upper clip range (DAPO's clip-higher; None: epsilon)", minimum=0)
    delta: float | None = option(None, "two-sided clipping: the unclipped ratio capped at delta (INTELLECT-2)")
    beta: float = option(0.0, "k3 KL to a frozen copy of the starting model", minimum=0,
                         why=" (the KL penalty's weight; 0 keeps no reference model)")
    sync_ref_model: bool = option(False, "every ref_model_sync_steps steps the reference becomes alpha x policy + "
                                         "(1 - alpha) x reference (TR-DPO; TRL's)")
    ref_model_mixup_alpha: float = option(0.6, "the policy's share in a reference sync", minimum=0, maximum=1)
    ref_model_sync_steps: int = option(512, "optimizer steps between reference syncs", minimum=1)
    router_aux_loss_coef: float | None = option(None, "mixture-of-experts models: weight of the load-balancing loss "
                                                      "added to the policy loss (None: the model config's own, 0: "
                                                      "off; TRL's)", minimum=0)
    use_bias_correction_kl: bool = option(True, "the KL term times the importance weight")
    num_iterations: int = option(1, "optimizer steps per rollout, with the sampling-time logprobs as the old "
                                    "policy", minimum=1)
    old_logprobs: str = option("trainer", "the old policy's logprobs in the clipped ratio: the trainer's (recomputed "
                                          "with num_iterations > 1, else its own detached) or the sampler's as it "
                                          "drew them (engine: TRL's AsyncGRPOTrainer's ratio; the sampling correction "
                                          "then weighs 1)", choices=("trainer", "engine"))
    mask_truncated_completions: bool = option(False, "completions that hit the length limit get no loss")
    filter_zero_std_groups: bool = option(False, "drop groups whose rewards are all equal (no signal)")
    sapo_temperature_pos: float = option(1.0, "SAPO's gate temperature for positive advantages", minimum=1e-6)
    sapo_temperature_neg: float = option(1.05, "SAPO's gate temperature for negative advantages", minimum=1e-6)
    vespo_k_pos: float = option(2.0, "VESPO's Gamma shape k for positive advantages")
    vespo_lambda_pos: float = option(3.0, "VESPO's Gamma rate lambda for positive advantages")
    vespo_k_neg: float = option(3.0, "VESPO's Gamma shape k for negative advantages")
    vespo_lambda_neg: float = option(2.0, "VESPO's Gamma rate lambda for negative advantages")

    def check(self) -> None:
        if isinstance(self.scale_rewards, bool):  # TRL maps booleans
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")
        if self.sync_ref_model and self.beta == 0.0:
            raise ValueError("sync_ref_model moves the reference of the KL term, which beta=0 leaves out: set beta > 0 "
                             "or sync_ref_model=false")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator != "grpo":
            raise ValueError("multi_objective_aggregation='normalize_then_sum' computes the advantages itself (TRL's "
                             f"definition); it takes advantage_estimator='grpo', got {self.advantage_estimator!r}")
        kind = registry.loss_type(self.loss_type)  # a registered record (built-in or plugin), or an error
        registry.advantage_estimator(self.advantage_estimator)
        if kind.preferred_level not in (None, self.importance_sampling_level):
            log.warning("loss_type=%r is meant with importance_sampling_level=%r (got %r)", kind.name,
                        kind.preferred_level, self.importance_sampling_level)

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class CorrectionOptions(OptionGroup):
    """TRL's correction for a sampler whose logprobs differ from the trainer's (TRL names it after vLLM, its
    sampler; rlcu's sampler is its own engine, which can still differ by a kernel's arithmetic)."""
    title: ClassVar[str] = "correction"
    vllm_importance_sampling_correction: bool = option(True, "each token's loss times pi_old / pi_sampler")
    vllm_importance_sampling_mode: str = option("sequence_mask", "per token or per sequence, truncated or zeroed "
                                                                 "outside [clip_min, clip_max]",
                                                choices=SAMPLING_CORRECTION_MODES)
    vllm_importance_sampling_clip_max: float | None = option(3.0, "upper bound of the weight", minimum=0)
    vllm_importance_sampling_clip_min: float | None = option(None, "lower bound of the weight", minimum=0)
    off_policy_mask_threshold: float | None = option(None, "drop a negative-advantage sequence whose mean "
                                                           "sampler-to-policy KL exceeds it (DeepSeek-V3.2)", minimum=0)
    importance_sampling_correction: bool | None = option(None, "rlcu's neutral name of "
                                                               "vllm_importance_sampling_correction",
                                                         alias_of="vllm_importance_sampling_correction")
    importance_sampling_mode: str | None = option(None, "rlcu's neutral name of vllm_importance_sampling_mode",
                                                  alias_of="vllm_importance_sampling_mode")
    importance_sampling_clip_max: float | None = option(None, "rlcu's neutral name of "
                                                              "vllm_importance_sampling_clip_max",
                                                        alias_of="vllm_importance_sampling_clip_max")
    importance_sampling_clip_min: float | None = option(None, "rlcu's neutral name of "
                                                              "vllm_importance_sampling_clip_min",
                                                        alias_of="vllm_importance_sampling_clip_min")

    def check(self) -> None:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low > high:
            raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be <= vllm_importance_sampling_clip_max "
                             f"({high})")

    @property
    def enabled(self) -> bool:
        return bool(self.vllm_importance_sampling_correction)

    @property
    def mode(self) -> str:
        return self.vllm_importance_sampling_mode


@dataclass(frozen=True)
class EntropyOptions(OptionGroup):
    title: ClassVar[str] = "entropy"
    top_entropy_quantile: float = option(1.0, "train only on the top fraction of tokens by entropy (1 keeps every "
                                              "token)", minimum=0, maximum=1)
    entropy_coef: float = option(0.0, "entropy bonus coefficient")
    use_adaptive_entropy: bool = option(False, "Skywork-OR1's adaptive coefficient")
    entropy_coef_min: float = option(0.0, "the adaptive coefficient's lower bound")
    entropy_coef_max: float = option(1.0, "the adaptive coefficient's upper bound")
    entropy_coef_delta: float = option(0.005, "the adaptive coefficient's step", minimum=0)
    entropy_target: float = option(0.2, "the entropy the adaptive coefficient steers to", minimum=0)

    def check(self) -> None:
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError("entropy_coef_min must be <= entropy_coef_max")

    @property
    def active(self) -> bool:
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy


@dataclass(frozen=True)
class OptimizerOptions(OptionGroup):
    title: ClassVar[str] = "optimizer"
    learning_rate: float = option(1e-6, "AdamW's learning rate", minimum=0)
    weight_decay: float = option(0.0, "AdamW's weight decay", minimum=0)
    adam_betas: tuple[float, float] = option((0.9, 0.999), "AdamW's betas")
    adam_state_dtype: str = option("float32", "AdamW's moments in float32 or bfloat16 (stochastic rounding)",
                                   choices=ADAM_STATE_DTYPES)
    optimizer_offload: bool = option(False, "AdamW's fp32 masters and moments in host memory")
    master_weights: bool = option(True, "fp32 master copies of bf16 weights in AdamW; False: the bf16 weights are "
                                        "updated in place with stochastic rounding (4 bytes a parameter less)")
    adam_epsilon: float = option(1e-8, "AdamW's epsilon", minimum=0)
    lr_scheduler: str = option("linear", "transformers' schedule by TRL's name: linear, cosine, cosine_with_min_lr "
                                           "(lr_scheduler_kwargs: min_lr or min_lr_rate), constant (no warm-up), "
                                           "constant_with_warmup", choices=SCHEDULES)
    lr_scheduler_type: str | None = option(None, "TRL's name of lr_scheduler", alias_of="lr_scheduler")
    lr_scheduler_kwargs: dict | None = option(None, "the schedule's own arguments (TRL's), e.g. {min_lr_rate: 0.1}")
    warmup_steps: float = option(0, "steps of linear warm-up; a value below 1 is a ratio of max_steps (TRL's)",
                                 minimum=0)
    max_grad_norm: float | None = option(1.0, "gradient clipping (None or 0: off)", minimum=0,
                                         why=" (a norm; None or 0: no clipping)")
    micro_batch_size: int = option(8, "sequences per forward/backward (gradient accumulation over the step)",
                                   minimum=1)
    steps_per_rollout: int = option(1, "optimizer steps a rollout feeds, each on a slice of its rows, shuffled "
                                       "(TRL's steps_per_generation / gradient_accumulation_steps)", minimum=1)
    gradient_checkpointing: bool = option(False, "recompute activations in backward")
    packing: bool = option(False, "training forward without padding: each micro-batch's tokens as one sequence")

    def check(self) -> None:
        object.__setattr__(self, "adam_betas", tuple(self.adam_betas))  # YAML gives a list
        if self.lr_scheduler == "cosine_with_min_lr" and not set(self.lr_scheduler_kwargs or {}) & {"min_lr",
                                                                                                   "min_lr_rate"}:
            raise ValueError("lr_scheduler='cosine_with_min_lr' needs lr_scheduler_kwargs with min_lr or min_lr_rate "
                             "(transformers' arguments), e.g. {min_lr_rate: 0.1}")
        if not self.master_weights and self.optimizer_offload:
            raise ValueError(OFFLOAD_WITHOUT_MASTERS)
        if self.lr_scheduler == "constant" and self.warmup_steps:
            log.warning("lr_scheduler='constant' takes no warm-up (transformers' meaning, as in TRL): warmup_steps=%s "
                        "is not used; lr_scheduler='constant_with_warmup' warms up", self.warmup_steps)

    def warmup(self, total_steps: int | None) -> int:
        """Warm-up steps: warmup_steps, or below 1 its ratio of the run's steps, rounded up (transformers')."""
        if self.warmup_steps >= 1 or self.warmup_steps == 0:
            return int(self.warmup_steps)
        if total_steps is None:
            raise ValueError(f"warmup_steps={self.warmup_steps} is a ratio of the run's steps: set trainer.max_steps")
        return math.ceil(total_steps * self.warmup_steps)


@dataclass(frozen=True)
class ModelOptions(OptionGroup):
    title: ClassVar[str] = "model"
    dtype: str = option("float32", "weights' dtype when loading by name")
    trust_remote_code: bool = option(False, "run code that a model's repository ships (transformers')")
    low_cpu_mem_usage: bool = option(False, "build the model without memory and read its weights in configure_model "
                                            "(Lightning's hook, before fitting): under tensor parallelism each rank "
                                            "reads only its shares, as slices of the checkpoint's files "
                                            "(transformers' name)")
    cast_lm_head_to_fp32: bool = option(False, "the LM head's weight in float32 and its logits computed in float32, "
                                               "in the sampler and the trainer (TRL's, from ScaleRL)")
    exact_logprobs: bool = option(False, "the sampler's logprobs equal the trainer's to the bit (batch-invariant "
                                         "kernels on both sides)")
    score_during_generation: bool = option(False, "score completions as they end, while the rest decode")


@dataclass(frozen=True)
class EvaluationOptions(OptionGroup):
    title: ClassVar[str] = "evaluation"
    eval_num_samples: int = option(4, "samples per held-out prompt for eval/pass@k and eval/mean@k (0 or 1: greedy "
                                      "only)", minimum=0)
    num_generations_eval: int | None = option(None, "TRL's name of eval_num_samples", minimum=0,
                                              alias_of="eval_num_samples")
    accuracy_reward: str | None = option(None, "the reward whose value is eval/accuracy (None: the first)")
    eval_at_start: bool = option(True, "a held-out evaluation before the first step")
    log_unique_prompts: bool = option(False, "the completions table keeps one row per prompt (TRL's)")


@dataclass(frozen=True)
class FaultOptions(OptionGroup):
    title: ClassVar[str] = "faults"
    max_consecutive_faults: int = option(3, "updates in a row skipped for numerical faults before the run stops",
                                         minimum=1)
    reward_timeout: float | None = option(300.0, "seconds each reward call may take (None: no limit)",
                                          minimum=1e-9, why=" seconds (or null: no limit)")
    on_reward_error: str = option("raise", "a reward that raises or runs over: stop the run (raise) or score those "
                                           "samples None (none)", choices=ON_REWARD_ERROR)
    reward_isolation: str = option("thread", "where reward functions run: in a thread (a call past reward_timeout is "
                                             "left running), or in a forked process that reward_timeout kills",
                                   choices=ISOLATION)


@dataclass(frozen=True)
class AgentLimits(OptionGroup):
    title: ClassVar[str] = "agents"
    max_tool_calling_iterations: int | None = option(None, "rounds of tool calls per episode (None: bounded by "
                                                           "max_completion_length)", minimum=1)
    tool_format: str = option("template", "the tokenizer's chat template, or rlcu's hermes format for templates "
                                          "without tools", choices=TOOL_FORMATS)
    tool_timeout: float | None = option(60.0, "seconds a tool call (or an environment's step) may take",
                                        minimum=1e-9, why=" seconds (or null: no limit)")
    tool_isolation: str = option("thread", "where tools run: in a thread (a call past tool_timeout is left running), "
                                           "or in a forked process that tool_timeout kills; an environment's methods "
                                           "always run in the trainer's process", choices=ISOLATION)
    agent_timeout: float | None = option(600.0, "seconds an agent program's episode may take, from its start to "
                                                "its return", minimum=1e-9, why=" seconds (or null: no limit)")
    agent_history: str = option("exact", "what an agent program's later calls must repeat of the turns the endpoint "
                                         "served: the messages as served (exact), or any assistant message in their "
                                         "place (served: for frameworks that write them back in a form of their own, "
                                         "as smolagents does; the sample keeps the served tokens)",
                                choices=AGENT_HISTORIES)
    agent_processes: int = option(
        AUTO_PROCESSES, "worker processes the agent programs run in (each rollout's episodes spread over them), so "
        "that the programs' Python does not take the interpreter lock the engine needs between its steps; the "
        "program, its rows and its returns must pickle (docs/agents.md); 0: a thread of the trainer's process; -1: "
        "processes (one per 4 CPU cores, 1 to 4) under the rlcu command where the program pickles, a thread "
        "otherwise", minimum=AUTO_PROCESSES, why=" (-1: auto)")
    max_branches: int = option(0, "conversations an agent program's episode may start besides its first (a "
                                  "sub-agent, a retry, another sample of the same messages), each trained as one more "
                                  "sample of the episode's group with the episode's advantage; 0: such a call gets "
                                  "HTTP 409 (docs/agents.md)", minimum=0)
    max_call_tokens: int | None = option(None, "tokens one call of an agent program may sample (a call cut there "
                                               "ends with finish_reason length); None: the episode's remaining "
                                               "max_completion_length", minimum=1)
    tool_result_max_chars: int = option(MAX_RESULT_CHARS, "characters of a tool result the model reads; the rest "
                                                          "is cut, with a note, before tokenizing", minimum=1)


@dataclass(frozen=True)
class StreamingOptions(OptionGroup):
    title: ClassVar[str] = "streaming"
    streaming: bool = option(False, "the rollout never drains: each step trains on the groups that finished first "
                                    "while the others decode on, across optimizer steps (docs/streaming.md)")
    max_staleness: int = option(4, "streaming: optimizer steps a sample's oldest token may lag the policy it trains "
                                   "(TRL's AsyncGRPOTrainer's); groups with an older sample are dropped", minimum=0)
    max_inflight_tasks: int = option(-1, "streaming: samples in flight, in whole steps (TRL's; -1: max(max_staleness, "
                                         "1) steps' worth)", minimum=-1)
    decode_steps_during_training: int = option(0, "streaming: decode steps each step runs beside its scoring and "
                                                  "training, on the weights before its optimizer step (0: none; -1: "
                                                  "until the training is done, as many as fit, not reproducible); "
                                                  "the KV pool then stays allocated through training", minimum=-1)

    def check(self) -> None:
        if self.max_inflight_tasks == 0:
            raise ValueError("max_inflight_tasks must be -1 (auto) or at least 1, got 0")
        if self.streaming:
            return
        if self.decode_steps_during_training:
            raise ValueError(f"decode_steps_during_training={self.decode_steps_during_training} decodes the streaming "
                             "rollout beside training: set streaming=true, or decode_steps_during_training=0")
        moved = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name in ("max_staleness", "max_inflight_tasks") and getattr(self, f.name) != f.default]
        if moved:  # a synchronous step trains on the policy that sampled it: the setting would do nothing
            raise ValueError(f"{', '.join(moved)} bounds the streaming rollout: set streaming=true, or leave it at "
                             "its default")


GROUPS: tuple[type[OptionGroup], ...] = (SamplingOptions, LossOptions, CorrectionOptions, EntropyOptions,
                                         OptimizerOptions, ModelOptions, EvaluationOptions, FaultOptions, AgentLimits,
                                         StreamingOptions)


@dataclass(frozen=True)
class Options:
    """Every option of a GRPO run, by group."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    loss: LossOptions = field(default_factory=LossOptions)
    correction: CorrectionOptions = field(default_factory=CorrectionOptions)
    entropy: EntropyOptions = field(default_factory=EntropyOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    faults: FaultOptions = field(default_factory=FaultOptions)
    agents: AgentLimits = field(default_factory=AgentLimits)
    streaming: StreamingOptions = field(default_factory=StreamingOptions)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> "Options":
        """The one adapter from flat names (TRL's, rlcu's, and their aliases) to the groups: an unknown name is an
        error naming the closest option; an alias given beside its option must agree with it."""
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], list(FIELDS), n=1)
            raise TypeError(f"unknown GRPO option {unknown[0]!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        per_group: dict[str, dict] = {}
        for name, value in resolve_aliases(values).items():
            per_group.setdefault(FIELDS[name][0], {})[name] = value
        return cls(**{g: GROUP_OF[g](**kw) for g, kw in per_group.items()})

    def flat(self) -> dict[str, Any]:
        """Every option by its flat name, aliases left out (what checkpoints and config.yaml record)."""
        out = {}
        for group in fields(self):
            part = getattr(self, group.name)
            out.update({f.name: getattr(part, f.name) for f in fields(part) if not f.metadata["alias_of"]})
        return out


def trl_alias(name: str, value, default, alias: str, alias_value):
    """One of GRPOModule's own arguments given by its TRL name (`reward_funcs` for `rewards`): the alias wins
    when set; both set and different is an error naming both."""
    if alias_value is None:
        return value
    same = lambda a, b: (list(a) if isinstance(a, tuple) else a) == (list(b) if isinstance(b, tuple) else b)
    if not same(value, default) and not same(value, alias_value):
        raise ValueError(f"{alias} and {name} are one argument (TRL's name and rlcu's); give only one")
    return alias_value


def resolve_aliases(values: Mapping[str, Any]) -> dict[str, Any]:
    """An alias that is set (not None) gives its value to the option it names; both set and different (the option
    off its default) is an error naming both."""
    out = dict(values)
    for alias, name in ALIASES.items():
        value = out.pop(alias, None)
        if value is None:
            continue
        default = DEFAULTS[name]
        if name in out and out[name] not in (default, value):
            raise ValueError(f"{alias} and {name} are one option (two names for it); give only one")
        out[name] = value
    return out


FIELDS = {f.name: (g.title, f) for g in GROUPS for f in fields(g)}  # flat name -> (group, its field)
# another name of an option -> the option it names (given both, they must agree)
ALIASES = {name: f.metadata["alias_of"] for name, (_, f) in FIELDS.items() if f.metadata["alias_of"]}
GROUP_OF = {g.title: g for g in GROUPS}
DEFAULTS = {name: (f.default if f.default is not MISSING else f.default_factory()) for name, (_, f) in FIELDS.items()}


def check_against_model(options: Options, context_length: int, reward_names: list[str]) -> None:
    """The options that depend on the model's context length and the run's reward names."""
    s = options.sampling
    total = s.max_prompt_length + s.max_completion_length
    if total > context_length:
        raise ValueError(f"max_prompt_length + max_completion_length = {total} exceeds the model's context of "
                         f"{context_length} tokens; lower one of them")
    accuracy = options.evaluation.accuracy_reward
    if accuracy is not None and accuracy not in reward_names:
        raise ValueError(f"accuracy_reward {accuracy!r} is not one of this run's rewards {reward_names}")


def signature(init: Callable) -> tuple[inspect.Signature, str]:
    """`init`'s own parameters then every option as a keyword with its type and default, and a docstring whose
    `Args:` give each option's group and help: what LightningCLI (jsonargparse) reads for `--help`, YAML and
    `--model.key=value`, and what Python's help() shows."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    params, docs = list(own), []
    for group in GROUPS:
        hints = typing.get_type_hints(group)
        for f in fields(group):
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[f.name],
                                            annotation=hints[f.name]))
            docs.append(f"    {f.name}: [{group.title}] {f.metadata['help']}")
    doc = inspect.cleandoc(init.__doc__ or "")
    doc += ("\n" if "\nArgs:" in doc else "\n\nArgs:\n") + "\n".join(docs) + "\n"
    return inspect.Signature(params), doc
