"""GRPOModule's options, each checked here, once, at construction: an error names the option, what it
got and what it takes."""
from __future__ import annotations

import logging
from collections.abc import Mapping

from rlcu.grpo import registry
from rlcu.grpo.loss import LEVELS, SAMPLING_CORRECTION_MODES, SCALES, SamplingCorrection
from rlcu.grpo.optim import STATE_DTYPES
from rlcu.rewards.scoring import ON_ERROR

log = logging.getLogger(__name__)
SCHEDULES = ("constant", "linear", "cosine")
LONG_PROMPTS = ("error", "truncate_left")  # a prompt over max_prompt_length: stop at set-up, or keep its end
# num_iterations > 1 needs the sampling-time logprobs: recomputed by a forward pass ("trainer"), or the ones
# the engine returned with its samples ("engine": no extra pass; logprob_mismatch/* says how far they are)
OLD_LOGPROBS = ("trainer", "engine")

CHOICES = {"importance_sampling_level": LEVELS, "scale_rewards": SCALES,
           "lr_scheduler": SCHEDULES, "long_prompts": LONG_PROMPTS, "old_logprobs": OLD_LOGPROBS,
           "on_reward_error": ON_ERROR, "adam_state_dtype": tuple(STATE_DTYPES)}
MINIMUM = {"num_generations": (2, " (GRPO compares completions within a group)"), "micro_batch_size": (1, ""),
           "num_iterations": (1, ""), "max_prompt_length": (1, ""), "max_completion_length": (1, ""),
           "max_consecutive_faults": (1, ""), "eval_num_samples": (0, " (0 or 1: greedy only)"),
           "epsilon": (0, ""), "warmup_steps": (0, ""), "learning_rate": (0, ""), "top_entropy_quantile": (0, ""),
           "entropy_coef_delta": (0, ""), "sapo_temperature_pos": (1e-6, ""), "sapo_temperature_neg": (1e-6, "")}


def check_options(options: Mapping) -> None:
    """`options`: the module's hyper-parameters (before any model is loaded)."""
    for name, allowed in CHOICES.items():
        if options[name] not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {options[name]!r}")
    for name, (low, why) in MINIMUM.items():
        if options[name] < low:
            raise ValueError(f"{name} must be >= {low}{why}, got {options[name]}")
    if options["top_entropy_quantile"] > 1:
        raise ValueError("top_entropy_quantile must be in [0, 1] (1 keeps every token), "
                         f"got {options['top_entropy_quantile']}")
    if options["entropy_coef_min"] > options["entropy_coef_max"]:
        raise ValueError("entropy_coef_min must be <= entropy_coef_max")
    kind = registry.loss_type(options["loss_type"])  # a registered record (built-in or plugin), or an error
    registry.advantage_estimator(options["advantage_estimator"])
    level = options["importance_sampling_level"]
    if kind.preferred_level not in (None, level):
        log.warning("loss_type=%r is meant with importance_sampling_level=%r (got %r)", kind.name, kind.preferred_level,
                    level)
    timeout = options["reward_timeout"]
    if timeout is not None and timeout <= 0:
        raise ValueError(f"reward_timeout must be a positive number of seconds or null (no limit), got {timeout}")


# rlcu's neutral names for TRL's options of the sampler correction (TRL names them after vLLM, its sampler)
ALIASES = {"importance_sampling_correction": "vllm_importance_sampling_correction",
           "importance_sampling_mode": "vllm_importance_sampling_mode",
           "importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
           "importance_sampling_clip_min": "vllm_importance_sampling_clip_min"}
TRL_DEFAULTS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
                "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": None}


def sampling_correction(options: Mapping) -> SamplingCorrection:
    """The sampler correction from TRL's names or their aliases (an alias given wins over TRL's default; both
    given and different is an error), checked."""
    values = {}
    for alias, name in ALIASES.items():
        value = options[name]
        if options[alias] is not None:
            if value != TRL_DEFAULTS[name] and value != options[alias]:
                raise ValueError(f"{alias} and {name} are one option (rlcu's name and TRL's); give only one")
            value = options[alias]
        values[name] = value
    mode = values["vllm_importance_sampling_mode"]
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {SAMPLING_CORRECTION_MODES}, got {mode!r}")
    low, high = values["vllm_importance_sampling_clip_min"], values["vllm_importance_sampling_clip_max"]
    if low is not None and high is not None and low > high:
        raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be <= vllm_importance_sampling_clip_max "
                         f"({high})")
    # VESPO folds the correction into its sequence weight, where a sequence-level ratio is as good as the product
    # of token ratios (TRL accepts only token modes there, and only with vLLM; without vLLM, its default, TRL
    # applies no correction, so a TRL config with loss_type vespo must run here with the default mode too)
    return SamplingCorrection(bool(values["vllm_importance_sampling_correction"]), mode, low, high,
                              options["off_policy_mask_threshold"])


EVAL_NUM_SAMPLES = 4  # rlcu's default samples per held-out prompt (pass@4, mean@4)


def eval_samples(options: Mapping) -> int:
    """Samples per held-out prompt for pass@k / mean@k: `eval_num_samples`, or TRL's `num_generations_eval`
    (the same option under TRL's name, so a TRL config carries over; both given and different is an error)."""
    trl, ours = options["num_generations_eval"], options["eval_num_samples"]
    if trl is None:
        return ours
    if trl < 0:
        raise ValueError(f"num_generations_eval must be >= 0 (0 or 1: greedy only), got {trl}")
    if ours not in (EVAL_NUM_SAMPLES, trl):
        raise ValueError(f"num_generations_eval ({trl}) and eval_num_samples ({ours}) are one option (TRL's name "
                         "and rlcu's); give only one")
    return trl


def check_against_model(options: Mapping, context_length: int, reward_names: list[str]) -> None:
    """The options that depend on the model's context length and the run's reward names."""
    total = options["max_prompt_length"] + options["max_completion_length"]
    if total > context_length:
        raise ValueError(f"max_prompt_length + max_completion_length = {total} exceeds the model's context of "
                         f"{context_length} tokens; lower one of them")
    accuracy = options["accuracy_reward"]
    if accuracy is not None and accuracy not in reward_names:
        raise ValueError(f"accuracy_reward {accuracy!r} is not one of this run's rewards {reward_names}")
