"""A TRL 1.16 GRPO configuration as rlcu's: every field of `GRPOConfig` (and of the `trl grpo` script's model,
script and dataset-mixture arguments) is either mapped to an rlcu option, the Lightning Trainer or the data
module, accepted as meaningless here with the reason, or refused by name with the reason when it is set. Fields
a config leaves out take TRL's defaults, not rlcu's, so an imported config trains as TRL would have.

`translate(values)` -> `Translation` (model options, trainer and data arguments, the seed, and one line per
field saying what became of it). `rlcu run --trl_config FILE` and `GRPOModule.from_trl` use it; docs/from-trl.md
is its table."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ALL = object()  # a rule's default: any value is fine (the field has no TRL default to compare with)


@dataclass(frozen=True)
class Rule:
    kind: str  # "model" | "trainer" | "data" | "custom" | "noop" | "refuse"
    target: str | None = None  # the rlcu name (model option, Trainer or data module argument)
    default: Any = ALL  # TRL's default (noop and refuse rules act only when a value differs from it)
    why: str = ""
    apply: Callable[[Any, "Translation", Mapping], None] | None = None  # custom rules


def to_model(default: Any, name: str | None = None) -> Rule:
    return Rule("model", name, default)


def noop(why: str, default: Any = ALL) -> Rule:
    return Rule("noop", None, default, why)


def refuse(why: str, default: Any = None) -> Rule:
    return Rule("refuse", None, default, why)


def custom(apply: Callable, default: Any = ALL, why: str = "") -> Rule:
    return Rule("custom", None, default, why, apply)


@dataclass
class Translation:
    model: dict[str, Any] = field(default_factory=dict)  # GRPOModule's options and arguments
    trainer: dict[str, Any] = field(default_factory=dict)  # lightning.Trainer's arguments
    data: dict[str, Any] = field(default_factory=dict)  # PromptDataModule's arguments
    seed: int | None = None
    lines: list[str] = field(default_factory=list)  # what became of each field that was set

    def config(self) -> dict[str, Any]:
        """A LightningCLI config (`rlcu fit --config`)."""
        return {"seed_everything": self.seed, "trainer": self.trainer, "model": self.model, "data": self.data}


# ---- the custom rules ------------------------------------------------------------------------------------------
def _batch(_, t: Translation, v: Mapping) -> None:
    """TRL's generation: per_device_train_batch_size x steps_per_generation completions a process (steps_per_generation
    defaults to gradient_accumulation_steps), in groups of num_generations: that many prompts a process
    (data.batch_size); each optimizer step takes gradient_accumulation_steps of TRL's per-device batches, so a
    rollout feeds steps_per_generation / gradient_accumulation_steps optimizer steps (model.steps_per_rollout); a
    micro-batch is TRL's per-device batch."""
    per_device, accumulation = v["per_device_train_batch_size"], v["gradient_accumulation_steps"]
    g, world = v["num_generations"], v.get("world_size", 1)
    generation, steps_per_generation = v.get("generation_batch_size"), v.get("steps_per_generation")
    # a GRPOConfig object sets both (its __post_init__ derives one from the other, for the processes it saw)
    if steps_per_generation is not None and generation not in (None, per_device * steps_per_generation,
                                                               per_device * world * steps_per_generation):
        raise ValueError(f"generation_batch_size={generation} and steps_per_generation={steps_per_generation} "
                         f"disagree: per_device_train_batch_size x processes x steps_per_generation is "
                         f"{per_device * world * steps_per_generation}; give one of them")
    if steps_per_generation is None and generation is not None:
        if generation % (per_device * world):
            raise ValueError(f"generation_batch_size={generation} is not a multiple of per_device_train_batch_size x "
                             f"processes = {per_device * world} (TRL requires the same)")
        steps_per_generation = generation // (per_device * world)
    steps_per_generation = steps_per_generation or accumulation
    if steps_per_generation % accumulation:
        raise ValueError(f"steps_per_generation={steps_per_generation} is not a multiple of "
                         f"gradient_accumulation_steps={accumulation}: rlcu's optimizer steps take whole slices of a "
                         "rollout; use a multiple")
    completions = per_device * steps_per_generation
    if completions % g:
        raise ValueError(f"per_device_train_batch_size x steps_per_generation = {completions} completions is not a "
                         f"multiple of num_generations={g} (TRL requires the same)")
    steps = steps_per_generation // accumulation
    t.data["batch_size"] = completions // g
    t.model["micro_batch_size"] = per_device
    if steps > 1:
        t.model["steps_per_rollout"] = steps
    t.lines.append(f"per_device_train_batch_size={per_device} x steps_per_generation={steps_per_generation} / "
                   f"num_generations={g} -> data.batch_size={completions // g} prompts a process, "
                   f"model.micro_batch_size={per_device}" + (f", model.steps_per_rollout={steps}" if steps > 1 else ""))


def _epochs(value, t: Translation, v: Mapping) -> None:
    if (v.get("max_steps") or -1) <= 0:
        t.trainer["max_epochs"] = int(value) if float(value).is_integer() else value
        if not float(value).is_integer():
            raise ValueError(f"num_train_epochs={value}: rlcu trains whole epochs; give max_steps instead")


def _betas(_, t: Translation, v: Mapping) -> None:
    t.model["adam_betas"] = [v["adam_beta1"], v["adam_beta2"]]


def _precision(_, t: Translation, v: Mapping) -> None:
    import torch

    bf16, fp16 = v.get("bf16"), v.get("fp16")
    if fp16:
        t.trainer["precision"] = "16-mixed"
    elif bf16 or (bf16 is None and torch.cuda.is_available() and not v.get("use_cpu")):
        t.trainer["precision"] = "bf16-mixed"
    else:
        t.trainer["precision"] = "32-true"
    t.lines.append(f"bf16={bf16}, fp16={fp16} -> trainer.precision={t.trainer['precision']} (TRL's bf16=None: bf16 "
                   "on a GPU)")


def _report_to(value, t: Translation, v: Mapping) -> None:
    kinds = [value] if isinstance(value, str) else list(value or [])
    if "all" in kinds:
        kinds = ["wandb", "tensorboard"]
    loggers = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": v.get("output_dir") or "runs", "name": v.get("run_name") or "trl"}}]
    for kind in kinds:
        if kind == "wandb":
            loggers.append({"class_path": "rlcu.loggers.WandbLogger",
                            "init_args": {"project": v.get("project") or "huggingface", "name": v.get("run_name"),
                                          "save_dir": v.get("output_dir") or "runs"}})
        elif kind == "tensorboard":
            loggers.append({"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                            "init_args": {"save_dir": v.get("output_dir") or "runs"}})
        elif kind != "none":
            raise ValueError(f"report_to={kind!r}: rlcu logs to CSV, wandb and tensorboard; choose among those")
    t.trainer["logger"] = loggers


def _saving(_, t: Translation, v: Mapping) -> None:
    strategy = v.get("save_strategy", "steps")
    if strategy in ("no", None):
        t.trainer["enable_checkpointing"] = False
        return
    every = {"every_n_train_steps": int(v.get("save_steps", 500))} if strategy == "steps" else {"every_n_epochs": 1}
    limit = v.get("save_total_limit")
    t.trainer.setdefault("callbacks", []).append(
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {**every, "save_top_k": -1 if limit is None else int(limit),
                       **({"monitor": "step", "mode": "max"} if limit is not None else {})}})


def _evaluation(_, t: Translation, v: Mapping) -> None:
    strategy = v.get("eval_strategy", "no")
    if strategy in ("no", None):
        return
    if strategy == "steps":
        t.trainer["val_check_interval"] = int(v.get("eval_steps") or v.get("logging_steps") or 10)
        t.trainer["check_val_every_n_epoch"] = None
    t.model["eval_at_start"] = bool(v.get("eval_on_start", False))
    t.data["val_batch_size"] = int(v.get("per_device_eval_batch_size", 8))
    t.data["val_split"] = v.get("dataset_test_split", "test")
    t.data.setdefault("val_size", 256)
    t.lines.append(f"eval_strategy={strategy} -> held-out evaluation of {t.data['val_size']} rows of split "
                   f"{t.data['val_split']!r} (data.val_size sets how many)")


def _checkpointing(value, t: Translation, v: Mapping) -> None:
    newer = v.get("activation_checkpointing")
    t.model["gradient_checkpointing"] = bool(value if newer is None else newer)


def _seed(value, t: Translation, v: Mapping) -> None:
    """TRL's seed seeds the run, the sampler and (without data_seed) the data order."""
    t.seed = int(value)
    t.model["seed"] = int(value)
    t.data["seed"] = int(v["data_seed"]) if v.get("data_seed") is not None else int(value)


def _model_init(value, t: Translation, v: Mapping) -> None:
    kwargs = dict(value or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    if dtype not in (None, "auto"):
        t.model["dtype"] = str(dtype).removeprefix("torch.")
    if "trust_remote_code" in kwargs:
        t.model["trust_remote_code"] = bool(kwargs.pop("trust_remote_code"))
    kwargs.pop("revision", None) if kwargs.get("revision") in (None, "main") else None
    kwargs.pop("attn_implementation", None)
    if kwargs:
        raise ValueError(f"model_init_kwargs {sorted(kwargs)}: rlcu builds its own model; only dtype and "
                         "trust_remote_code apply")


def _generation_kwargs(value, t: Translation, v: Mapping) -> None:
    kwargs = dict(value or {})
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if name in kwargs:
            t.model[name] = kwargs.pop(name)
    if kwargs:
        raise ValueError(f"generation_kwargs {sorted(kwargs)}: rlcu's sampler takes temperature, top_p, top_k, "
                         "min_p and repetition_penalty; drop the others")


def _vllm_cap(value, t: Translation, v: Mapping) -> None:
    if value is not None:
        t.model["vllm_importance_sampling_clip_max"] = value


def _old_prompt_length(value, t: Translation, v: Mapping) -> None:
    if value is not None:
        t.model["max_prompt_length"] = value


def _dtype(value, t: Translation, v: Mapping) -> None:
    if value not in (None, "auto"):  # model_init_kwargs' dtype wins, as `trl grpo` updates its kwargs with them
        t.model.setdefault("dtype", str(value))


def _peft(_, t: Translation, v: Mapping) -> None:
    if not v.get("use_peft"):
        return
    for name, why in (("use_dora", "DoRA"), ("load_in_8bit", "8-bit bases"), ("load_in_4bit", "4-bit bases")):
        if v.get(name):
            raise ValueError(f"{name}=true: rlcu's LoRA has no {why}; set it false")
    if v.get("lora_modules_to_save"):
        raise ValueError("lora_modules_to_save: rlcu trains adapters only (lora_target_modules, and "
                         "lora_target_parameters for experts); leave it unset")
    t.model["peft_config"] = {"r": v.get("lora_r", 16), "lora_alpha": v.get("lora_alpha", 32),
                              "lora_dropout": v.get("lora_dropout", 0.05),
                              "target_modules": v.get("lora_target_modules") or "all-linear",
                              "use_rslora": bool(v.get("use_rslora")),
                              "target_parameters": v.get("lora_target_parameters")}


def _reward_funcs(value, t: Translation, v: Mapping) -> None:
    """The `trl grpo` script's reward model first, then its names (its registry: get_soft_overlong_punishment with
    1280 and 256) or paths."""
    model = v.get("reward_model_name_or_path")
    if value is None and model is None:
        return
    rewards = [model] if model is not None else []
    value = value or []
    for name in value:
        if name == "get_soft_overlong_punishment":
            rewards.append({"name": name, "init_args": {"max_completion_len": 1280, "soft_punish_cache": 256}})
        else:
            rewards.append(name)
    t.model["rewards"] = rewards


def _dataset_config(value, t: Translation, v: Mapping) -> None:
    if value is not None:
        t.data.setdefault("dataset_args", {})["name"] = value


HUB = "rlcu does not push to the hub: `rlcu export CHECKPOINT DIR`, then upload the folder"
PARALLEL = "rlcu runs DDP or its own FSDP2 (--trainer.strategy=fsdp2, docs/scaling.md)"
VLLM = "rlcu samples with its own engine on the trained parameters: there is no vLLM to configure"
LOGGING = "Lightning's logging: every logged step goes to each logger"
LOADER = "the prompts of a step are few: one loader process reads them"
EVAL = "rlcu's held-out evaluation is greedy accuracy, pass@k and reward (docs/recipes.md)"

RULES: dict[str, Rule] = {
    # ---- GRPOConfig's own fields
    "model_init_kwargs": custom(_model_init, None, "model.dtype and model.trust_remote_code"),
    "trust_remote_code": to_model(False),
    "router_aux_loss_coef": to_model(None),
    "disable_dropout": noop("rlcu's models have no dropout, and the transformers fallback turns dropout off", False),
    "cast_lm_head_to_fp32": to_model(False),
    "num_generations": to_model(8), "num_generations_eval": to_model(None), "max_completion_length": to_model(512),
    "ds3_gather_for_generation": noop("DeepSpeed ZeRO-3's; rlcu's fsdp2 gathers for the rollout itself", True),
    "shuffle_dataset": Rule("data", "shuffle", True), "pad_to_multiple_of": noop(
        "rlcu pads a micro-batch to its longest row (packing: no padding)", "auto"),
    "generation_batch_size": custom(lambda *a: None, None, "the rollout's size: data.batch_size prompts, "
                                                             "model.steps_per_rollout optimizer steps on it"),
    "steps_per_generation": custom(lambda *a: None, None, "divided by gradient_accumulation_steps: "
                                                          "model.steps_per_rollout (data.batch_size grows with it)"),
    "temperature": to_model(1.0), "top_p": to_model(1.0), "top_k": to_model(0), "min_p": to_model(None),
    "generation_kwargs": custom(_generation_kwargs, None, "the sampler's temperature, top_p, top_k, min_p, "
                                                          "repetition_penalty"),
    "chat_template_kwargs": to_model(None),
    "repetition_penalty": to_model(1.0),
    "cache_implementation": noop("the engine keeps its own paged KV cache", None),
    "use_vllm": noop(VLLM, False), "vllm_mode": noop(VLLM, "colocate"), "vllm_model_impl": noop(VLLM, "vllm"),
    "vllm_enable_sleep_mode": noop("nothing to sleep: the engine frees its KV pool after each rollout and holds no "
                                   "second copy of the weights", False),
    "vllm_structured_outputs_regex": refuse("rlcu's sampler has no structured (regex) decoding"),
    "vllm_server_base_url": noop(VLLM, None), "vllm_server_host": noop(VLLM, "0.0.0.0"),
    "vllm_server_port": noop(VLLM, 8000), "vllm_server_timeout": noop(VLLM, 240.0),
    "vllm_group_port": noop(VLLM, 51216),
    "vllm_gpu_memory_utilization": custom(lambda value, t, v: t.model.setdefault("rollout", {
        "name": "native", "init_args": {"engine": {"memory_fraction": value}}}) if v.get("use_vllm") else None, 0.3,
        "with use_vllm: the share of free GPU memory the engine's KV pool may take (engine.memory_fraction)"),
    "max_prompt_length": custom(_old_prompt_length, None, "model.max_prompt_length (TRL removed it in 0.28; rlcu "
                                "still bounds prompts with it: a longer one is an error, or loses its start with "
                                "long_prompts: truncate_left)"),
    "vllm_max_model_length": noop("the engine sizes each sequence by max_prompt_length + max_completion_length",
                                  None),
    "vllm_tensor_parallel_size": refuse("tensor-parallel rollouts are issue #46", 1),
    "beta": to_model(0.0), "num_iterations": to_model(1), "epsilon": to_model(0.2), "delta": to_model(None),
    "epsilon_high": to_model(None), "sapo_temperature_neg": to_model(1.05), "sapo_temperature_pos": to_model(1.0),
    "vespo_k_pos": to_model(2.0), "vespo_lambda_pos": to_model(3.0), "vespo_k_neg": to_model(3.0),
    "vespo_lambda_neg": to_model(2.0), "importance_sampling_level": to_model("token"), "reward_weights": to_model(None),
    "multi_objective_aggregation": to_model("sum_then_normalize"), "scale_rewards": to_model("group"),
    "loss_type": to_model("dapo"), "mask_truncated_completions": to_model(False),
    "sync_ref_model": to_model(False), "ref_model_mixup_alpha": to_model(0.6), "ref_model_sync_steps": to_model(512),
    "top_entropy_quantile": to_model(1.0), "entropy_coef": to_model(0.0), "use_adaptive_entropy": to_model(False),
    "entropy_coef_min": to_model(0.0), "entropy_coef_max": to_model(1.0), "entropy_coef_delta": to_model(0.005),
    "entropy_target": to_model(0.2), "max_tool_calling_iterations": to_model(None),
    "vllm_importance_sampling_correction": to_model(True), "vllm_importance_sampling_mode": to_model("sequence_mask"),
    "vllm_importance_sampling_clip_max": to_model(3.0), "vllm_importance_sampling_clip_min": to_model(None),
    "vllm_importance_sampling_cap": custom(_vllm_cap, None, "model.vllm_importance_sampling_clip_max (its old name)"),
    "off_policy_mask_threshold": to_model(None),
    "use_bias_correction_kl": to_model(True),
    "log_completions": noop("rlcu.callbacks.CompletionsTable writes completions.jsonl (and a wandb table)", False),
    "log_multimodal": noop("rlcu trains text models", True),
    "num_completions_to_print": noop("CompletionsTable's max_rows", None),
    "log_unique_prompts": to_model(False), "log_completions_hub_repo": refuse(HUB),
    "use_transformers_continuous_batching": noop("rlcu's engine batches continuously over a paged cache", False),
    "transformers_continuous_batching_config": noop("rlcu's engine batches continuously", None),
    "use_transformers_paged": noop("rlcu's engine is paged", False),
    # ---- AsyncGRPOConfig's own fields (TRL's asynchronous trainer: any of them, or that class, means streaming=True)
    "max_staleness": to_model(4), "max_inflight_tasks": to_model(-1),
    "queue_maxsize": noop("finished groups wait in the rollout stream, at most max_inflight_tasks samples", 1024),
    "weight_sync_steps": noop("the sampler reads the trainer's parameters: each optimizer step reaches it at once, "
                              "at no cost", 1),
    "heartbeat_stale_after_s": noop("the rollout runs in the trainer's process: no worker to watch", 300.0),
    "request_timeout": noop(VLLM, 600), "weight_sync_timeout": noop(VLLM, 1800),
    "token_budget": noop("micro_batch_size (and packing) bound what one forward holds", None),
    "fork_threshold_tokens": noop("episodes keep their sampled tokens as they were drawn: nothing is re-tokenized",
                                  1024),
    # ---- transformers' TrainingArguments (TRL's defaults where GRPOConfig changes them)
    "output_dir": Rule("trainer", "default_root_dir", None), "per_device_train_batch_size": custom(_batch, 8),
    "gradient_accumulation_steps": custom(lambda *a: None, 1),
    "num_train_epochs": custom(_epochs, 3.0, "trainer.max_epochs (without max_steps)"),
    "max_steps": Rule("trainer", "max_steps", -1), "learning_rate": to_model(1e-6),
    "lr_scheduler_type": to_model("linear", "lr_scheduler"), "lr_scheduler_kwargs": to_model(None),
    "warmup_steps": to_model(0), "weight_decay": to_model(0.0), "adam_beta1": custom(_betas, 0.9, "model.adam_betas"),
    "adam_beta2": custom(lambda *a: None, 0.999, "model.adam_betas"), "adam_epsilon": to_model(1e-8),
    "max_grad_norm": to_model(1.0),
    "optim": noop("rlcu's AdamW (fp32 masters; adam_state_dtype, master_weights, optimizer_offload)",
                  "adamw_torch_fused"),
    "optim_args": refuse("rlcu's optimizer is AdamW"), "optim_target_modules": refuse("rlcu's optimizer is AdamW"),
    "average_tokens_across_devices": noop("loss_type dapo divides by the step's tokens over every process", True),
    "label_smoothing_factor": refuse("GRPO's loss has no labels to smooth", 0.0),
    "bf16": custom(_precision, None), "fp16": custom(lambda *a: None, False),
    "bf16_full_eval": noop("evaluation runs in the training precision", False),
    "fp16_full_eval": noop("evaluation runs in the training precision", False),
    "tf32": noop("bf16 GEMMs; exactness from exact_logprobs", None),
    "activation_checkpointing": custom(lambda *a: None, None, "transformers' newer name of gradient_checkpointing"),
    "activation_checkpointing_kwargs": noop("rlcu checkpoints each decoder layer, non-reentrant", None),
    "gradient_checkpointing": custom(_checkpointing, True, "model.gradient_checkpointing"),
    "gradient_checkpointing_kwargs": noop(
        "rlcu checkpoints each decoder layer, non-reentrant", None),
    "torch_compile": refuse("rlcu's hot paths are its own Triton kernels and CUDA graphs; torch.compile is not "
                            "applied", False),
    "torch_compile_backend": refuse("no torch.compile"), "torch_compile_mode": refuse("no torch.compile"),
    "use_liger_kernel": noop("rlcu's own fused kernels (chunked log-softmax, RMSNorm, SwiGLU)", False),
    "liger_kernel_config": noop("rlcu's own fused kernels", None), "use_cache": noop("training runs no cache", False),
    "neftune_noise_alpha": refuse("no NEFTune noise in GRPO"),
    "torch_empty_cache_steps": noop("the engine frees its pool after each rollout", None),
    "auto_find_batch_size": refuse("set micro_batch_size", False),
    "logging_strategy": noop(LOGGING, "steps"), "logging_steps": Rule("trainer", "log_every_n_steps", 10),
    "logging_first_step": noop(LOGGING, False), "log_on_each_node": noop(LOGGING, True),
    "logging_nan_inf_filter": noop("a non-finite loss skips its update (faults/skipped_updates)", True),
    "include_num_input_tokens_seen": noop("num_tokens is logged every step", "no"),
    "log_level": noop("Python logging", "passive"), "log_level_replica": noop("Python logging", "warning"),
    "disable_tqdm": custom(lambda value, t, v: t.trainer.__setitem__("enable_progress_bar", not value) if value
                           is not None else None, None, "trainer.enable_progress_bar"),
    "report_to": custom(_report_to, "none", "trainer.logger: CSV, and wandb or tensorboard as named"),
    "run_name": noop("the loggers' name (report_to)", None),
    "project": noop("the wandb project (report_to)", "huggingface"),
    "trackio_space_id": refuse("rlcu logs to CSV, wandb and tensorboard"),
    "trackio_bucket_id": refuse("rlcu logs to CSV, wandb and tensorboard"),
    "trackio_static_space_id": refuse("rlcu logs to CSV, wandb and tensorboard"),
    "eval_strategy": custom(_evaluation, "no", "held-out evaluation every eval_steps (trainer.val_check_interval)"),
    "eval_steps": noop("with eval_strategy", None),
    "eval_delay": refuse("evaluation starts with the run (eval_on_start) or at its first interval", 0),
    "per_device_eval_batch_size": noop("with eval_strategy (data.val_batch_size)", 8),
    "prediction_loss_only": noop(EVAL, False), "eval_on_start": noop("with eval_strategy", False),
    "eval_do_concat_batches": noop(EVAL, True), "eval_use_gather_object": noop(EVAL, False),
    "eval_accumulation_steps": noop(EVAL, None), "include_for_metrics": noop(EVAL, []),
    "batch_eval_metrics": noop(EVAL, False), "save_only_model": noop("checkpoints hold what resuming needs", False),
    "save_strategy": custom(_saving, "steps", "a ModelCheckpoint callback every save_steps steps (no: none)"),
    "save_steps": noop("with save_strategy", 500),
    "save_on_each_node": noop("rank 0 saves", False), "save_total_limit": noop("with save_strategy", None),
    "enable_jit_checkpoint": noop("checkpoints are written atomically at their step", False),
    "push_to_hub": refuse(HUB, False), "hub_token": refuse(HUB), "hub_private_repo": refuse(HUB),
    "hub_model_id": refuse(HUB), "hub_strategy": noop("with push_to_hub", "every_save"),
    "hub_always_push": refuse(HUB, False), "hub_revision": refuse(HUB),
    "load_best_model_at_end": refuse("rlcu keeps the last step's weights; choose a checkpoint with rlcu eval", False),
    "metric_for_best_model": refuse("no best-model selection"), "greater_is_better": refuse("no best-model selection"),
    "ignore_data_skip": noop("a resumed run continues where its sampler was", False),
    "restore_callback_states_from_checkpoint": noop("Lightning restores callback states", False),
    "full_determinism": noop("every draw is seeded by (seed, request, token index)", False),
    "seed": custom(_seed, 42, "seed_everything, model.seed and (without data_seed) data.seed"),
    "data_seed": custom(lambda *a: None, None, "the data order's seed (data.seed)"),
    "use_cpu": custom(lambda value, t, v: t.trainer.__setitem__("accelerator", "cpu") if value else None, False,
                      "trainer.accelerator=cpu"),
    "accelerator_config": refuse("Lightning's Trainer replaces accelerate"),
    "parallelism_config": refuse(PARALLEL),
    "dataloader_drop_last": noop(LOADER, False), "dataloader_num_workers": noop(LOADER, 0),
    "dataloader_pin_memory": noop(LOADER, True), "dataloader_persistent_workers": noop(LOADER, False),
    "dataloader_prefetch_factor": noop(LOADER, None), "dataloader_multiprocessing_context": noop(LOADER, None),
    "dataloader_in_order": noop(LOADER, True),
    "remove_unused_columns": noop("every column reaches the rewards (TRL's GRPO default, false)", False),
    "label_names": noop("GRPO has no labels", None), "train_sampling_strategy": noop("data.shuffle", "random"),
    "length_column_name": noop("no length grouping", "length"),
    "ddp_find_unused_parameters": noop(PARALLEL, None), "ddp_bucket_cap_mb": noop(PARALLEL, None),
    "ddp_broadcast_buffers": noop(PARALLEL, None), "ddp_static_graph": noop(PARALLEL, None),
    "ddp_backend": noop(PARALLEL, None), "ddp_timeout": noop(PARALLEL, 1800),
    "fsdp": refuse(PARALLEL), "fsdp_config": refuse(PARALLEL), "deepspeed": refuse(PARALLEL),
    "debug": noop("RLCU_DEBUG=1 shows tracebacks", ""), "skip_memory_metrics": noop("memory/* is logged", True),
    "do_train": noop("rlcu run trains", False), "do_eval": noop("eval_strategy", False),
    "do_predict": noop("rlcu generate", False), "local_rank": noop("Lightning's launcher", -1),
    "resume_from_checkpoint": refuse("give the checkpoint as --ckpt_path"),
    # ---- the `trl grpo` script's model, script and dataset-mixture arguments
    "model_name_or_path": to_model(None, "model"), "model_revision": refuse(
        "rlcu loads a hub id's main revision; download the revision to a folder and give its path", "main"),
    "dtype": custom(_dtype, "float32", "model.dtype"),
    "attn_implementation": noop("rlcu's own attention kernels", None),
    "use_peft": custom(_peft, False, "model.peft_config from lora_r, lora_alpha, lora_dropout, lora_target_modules, "
                                     "lora_target_parameters, use_rslora"),
    "lora_r": noop("with use_peft", 16), "lora_alpha": noop("with use_peft", 32),
    "lora_dropout": noop("with use_peft", 0.05), "lora_target_modules": noop("with use_peft", None),
    "lora_target_parameters": noop("with use_peft", None), "lora_modules_to_save": noop("with use_peft", None),
    "lora_task_type": noop("causal LM", "CAUSAL_LM"), "use_rslora": noop("with use_peft", False),
    "use_dora": noop("with use_peft", False), "load_in_8bit": refuse("rlcu trains bf16 or fp32 weights", False),
    "load_in_4bit": refuse("rlcu trains bf16 or fp32 weights", False), "bnb_4bit_quant_type": noop("no bnb", "nf4"),
    "use_bnb_nested_quant": noop("no bnb", False), "bnb_4bit_quant_storage": noop("no bnb", None),
    "dataset_name": Rule("data", "dataset", None),
    "dataset_config": custom(_dataset_config, None, "data.dataset_args.name"),
    "dataset_train_split": Rule("data", "split", "train"), "dataset_test_split": noop("with eval_strategy", "test"),
    "dataset_streaming": refuse("rlcu reads the dataset once, at set-up", False),
    "ignore_bias_buffers": noop("no bias buffers in rlcu's models", False),
    "reward_model_name_or_path": custom(lambda value, t, v: None, None,
                                        "the first of model.rewards: a reward model (hub id or folder)"),
    "reward_funcs": custom(_reward_funcs, None, "model.rewards (the script's names: "
                                                            "get_soft_overlong_punishment with 1280 and 256)"),
    "datasets": refuse("one dataset (dataset_name)", []), "streaming": refuse("rlcu reads the dataset once", False),
    "test_split_size": refuse("data.val_size holds rows out", None),
}
BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "steps_per_generation",
         "generation_batch_size")


def values_of(config: Any) -> tuple[dict[str, Any], set[str]]:
    """(every field's value, the fields set) of a TRL config object (its fields that differ from its class's
    defaults) or a mapping (every key set), with TRL's defaults for the fields a mapping leaves out."""
    if dataclasses.is_dataclass(config):
        values, given = {}, set()
        for f in dataclasses.fields(config):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            values[f.name] = getattr(config, f.name)
            if values[f.name] != default:
                given.add(f.name)
        return values, given
    if not isinstance(config, Mapping):
        raise TypeError(f"a TRL config is a GRPOConfig or a mapping of its fields, got {type(config).__name__}")
    defaults = {name: rule.default for name, rule in RULES.items() if rule.default is not ALL}
    return {**defaults, **config}, set(config)


def _default_object(value) -> bool:
    """A settings object that TRL's __post_init__ made from None, holding only its defaults."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and value == type(value)()


ASYNC_FIELDS = {"max_staleness", "max_inflight_tasks", "queue_maxsize", "weight_sync_steps", "heartbeat_stale_after_s"}
# where AsyncGRPOConfig's defaults differ from GRPOConfig's (a mapping with its fields takes these)
ASYNC_DEFAULTS = {"lr_scheduler_type": "constant", "logging_steps": 1, "ignore_data_skip": True,
                  "remove_unused_columns": True, "max_completion_length": 2048,
                  "vllm_server_base_url": "http://localhost:8000"}


def _typed(name: str, value: Any, default: Any) -> Any:
    """A flag or number given as TRL types it (its default's kind), a number written as text taken as that number
    (YAML reads `1e-5` as text), or one line naming the field."""
    if value is None or isinstance(default, str) or not isinstance(default, (bool, int, float)):
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ValueError(f"TRL field {name}={value!r} must be true or false; fix its value")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value  # TRL types some integer-looking defaults as floats (warmup_steps)
    if isinstance(value, str):
        try:
            return int(value) if isinstance(default, int) and value.strip().lstrip("+-").isdigit() else float(value)
        except ValueError:
            pass
    raise ValueError(f"TRL field {name}={value!r} must be a number (TRL's default is {default!r}); fix its value")


def translate(config: Any, world_size: int = 1) -> Translation:
    """rlcu's configuration of a TRL GRPO config (a `GRPOConfig` or `AsyncGRPOConfig`, or its fields as a `trl grpo`
    YAML gives them)."""
    asynchronous = type(config).__name__ == "AsyncGRPOConfig" or (isinstance(config, Mapping)
                                                                  and bool(set(config) & ASYNC_FIELDS))
    if asynchronous and isinstance(config, Mapping):
        config = {**ASYNC_DEFAULTS, **config}
    values, given = values_of(config)
    if asynchronous:  # AsyncGRPOConfig sets its own accelerate batching (split and dispatch), not the user's choice
        given.discard("accelerator_config")
    unknown = sorted(set(values) - set(RULES))
    if unknown:
        raise ValueError(f"unknown TRL field {unknown[0]!r} (TRL 1.16's GRPOConfig and `trl grpo` arguments are "
                         "known); remove it or check its spelling")
    values.update({name: _typed(name, values[name], RULES[name].default) for name in given})
    t, v = Translation(), dict(values, world_size=world_size)
    if asynchronous:  # its loss clips the ratio to the logprobs the sampler drew, not the trainer's own
        t.model.update(streaming=True, old_logprobs="engine")
        t.lines.append("TRL's asynchronous trainer (AsyncGRPOConfig) -> model.streaming=True, "
                       "model.old_logprobs=engine (its ratio is to the sampler's logprobs)")
    for name, value in values.items():
        rule = RULES[name]
        set_here = name in given and value != rule.default and not _default_object(value)
        if rule.kind in ("model", "trainer", "data"):
            getattr(t, rule.kind)[rule.target or name] = value
            if name in given:
                t.lines.append(f"{name}={value!r} -> {rule.kind}.{rule.target or name}")
        elif rule.kind == "custom":
            rule.apply(value, t, v)
            if set_here and rule.why:
                t.lines.append(f"{name}={value!r} -> {rule.why}")
        elif rule.kind == "refuse" and set_here:
            raise ValueError(f"TRL field {name}={value!r} is not supported: {rule.why}")
        elif rule.kind == "noop" and set_here:
            t.lines.append(f"{name}={value!r}: no effect here ({rule.why})")
    t.model = {k: v for k, v in t.model.items() if v is not None or k in given}
    if t.model.get("model") is None:
        t.model.pop("model", None)
    t.data = {k: v for k, v in t.data.items() if v is not None}
    t.trainer = {k: v for k, v in t.trainer.items() if v is not None}
    return t


def field_table() -> list[tuple[str, str]]:
    """(TRL field, what rlcu does with it), for docs/from-trl.md."""
    rows = []
    for name, rule in RULES.items():
        if rule.kind in ("model", "trainer", "data"):
            rows.append((name, f"`{rule.kind}.{rule.target or name}`"))
        elif rule.kind == "custom":
            rows.append((name, rule.why or f"translated ({rule.apply.__name__.strip('_') or 'custom'})"))
        else:
            rows.append((name, ("no effect: " if rule.kind == "noop" else "refused when set: ") + rule.why))
    return rows


def markdown_table() -> str:
    """docs/from-trl.md's field table (`python -m rlcu.grpo.trl_config` prints it; a test keeps the page equal)."""
    rows = ["| TRL field | in rlcu |", "| --- | --- |"]
    rows += [f"| `{name}` | {what.replace('|', '/')} |" for name, what in field_table()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
