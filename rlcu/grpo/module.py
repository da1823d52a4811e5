"""GRPOModule: GRPO (and its DAPO / Dr. GRPO / GSPO variants) as a Lightning module with manual
optimization. One `training_step` is one GRPO step, in named phases:

    rollout:  G completions per prompt (rollout backend, on this module's own parameters)
    score:    rewards (plugins) -> group advantages -> a typed `GRPOBatch`
    update:   num_iterations x [micro-batched forward/backward, clip, optimizer step, LR schedule]

Options keep TRL's names and meanings, each defined once in a group of `options.py`. The maths are the pure
functions of `loss.py`, the loss types and advantage estimators registered records (`registry.py`); the data
passed between phases the dataclasses of `batch.py`. The score phase (`score_phase.Scoring`, whose `score()`
held-out evaluation uses too) and the update phase (`update.Update`) are objects built from their options and
dependencies; this module wires Lightning's hooks to them and answers what they ask of it (their `Host`)."""
from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.profiler import record_function
from transformers import get_scheduler

from rlcu import quiet, strategies  # noqa: F401  (strategies: registers --trainer.strategy=fsdp2 and tp)
from rlcu.agents import AgentOptions, EpisodeRunner
from rlcu.agents.formats import tool_format
from rlcu.agents.programs import AgentProgram, ProgramRunner, agent_reward, load_program
from rlcu.agents.workers import ProgramWorkers, resolve_processes
from rlcu.calls import CallInterrupted
from rlcu.contracts import (
    Continuation,
    GenerationInterrupted,
    Numerics,
    RolloutBatch,
    SamplingParams,
    TrainerState,
    Turn,
    eos_token_ids,
)
from rlcu.data.module import data_parallel_rank
from rlcu.data.prompts import as_rows, encode_prompt, encode_prompts
from rlcu.data.rows import RowView
from rlcu.grpo import evaluation, registry
from rlcu.grpo.batch import Counters, Sampled, ScoredRollout
from rlcu.grpo.early_scoring import EarlyScorer
from rlcu.grpo.optim import STATE_DTYPES, MasterWeightAdamW
from rlcu.grpo.options import ModelOptions, Options, check_against_model, signature, trl_alias
from rlcu.grpo.score_phase import Scoring
from rlcu.grpo.streaming import Prescored, Streamer
from rlcu.grpo.update import Update
from rlcu.hparams import plain
from rlcu.models import CausalLM, load_model
from rlcu.models.loading import load_pending, require_fits, weight_bytes
from rlcu.models.lora import add_lora
from rlcu.models.random_init import materialize
from rlcu.models.sharding import full_parameters, is_sharded, shard
from rlcu.models.tensor_parallel import parallelize, split_parameters
from rlcu.rewards.base import BoundReward, NonFiniteReward, resolve_rewards
from rlcu.rewards.model import RewardModel
from rlcu.rollout import bind, capabilities_of, require, resolve_rollout, turns

log = logging.getLogger(__name__)
PROGRESS_ROWS = 100_000  # training prompts from which their check at set-up shows a progress bar
MAX_CONSECUTIVE_SKIPS = 20  # batches in a row with no learning signal before the run stops


class TrainingFault(RuntimeError):
    """The run cannot go on: too many updates in a row were skipped, or had nothing to learn from."""


class GRPOModule(L.LightningModule):
    def __init__(self, model: str | CausalLM = "smollm2-135m-instruct", tokenizer: Any = None,
                 rewards: Any = ("math_answer",), reward_weights: list[float] | None = None, rollout: Any = "native",
                 peft_config: Any = None, tools: list | None = None, environment_factory: Any = None,
                 agent: Any = None, reward_funcs: Any = None, reward_processing_classes: Any = None, **options):
        """A GRPO run's module. Every option keeps TRL's name, default and meaning (`rlcu/grpo/options.py`).

        Args:
            model: a local HF folder, a hub id, a .gguf file, an embedded name, or a model object
            tokenizer: the model's tokenizer (None: the one saved with the model)
            rewards: reward functions, plugin names, import paths or {name, weight, init_args} mappings
            reward_weights: one weight per reward (None: each reward's own, 1.0 by default)
            rollout: the rollout backend: native, reference, a plugin's name, or an instance
            peft_config: LoRA: a PEFT LoraConfig or its fields
            tools: functions (or import paths) the model may call
            environment_factory: one environment per episode: a class, {name: class}, or a plugin spec
            agent: a program `async def agent(endpoint, row) -> reward | None`, or its import path (docs/agents.md)
            reward_funcs: TRL's name of rewards (give one of the two)
            reward_processing_classes: the tokenizers of reward models given as objects (TRL's)
        """
        # not super(): its `__class__` cell would make Lightning look for a local of every option of the signature
        L.LightningModule.__init__(self)
        quiet.install()
        self.options = opts = Options.from_flat(options)  # TRL's flat names -> the checked option groups
        rewards = trl_alias("rewards", rewards, ("math_answer",), "reward_funcs", reward_funcs)
        explicit = dict(model=model, tokenizer=tokenizer, rewards=rewards, reward_weights=reward_weights, agent=agent,
                        rollout=rollout, peft_config=peft_config, tools=tools, environment_factory=environment_factory)
        self.save_hyperparameters({**{k: v for k, v in explicit.items() if plain(v)}, **opts.flat()})
        self.automatic_optimization = False
        self.policy, self.tokenizer = self._policy(model, tokenizer, opts.model)
        self.policy.gradient_checkpointing = opts.optimizer.gradient_checkpointing
        self._add_lora(peft_config)
        self.rewards = self._agents_and_rewards(tools, environment_factory, agent, rewards, reward_weights,
                                                reward_processing_classes)
        names = [r.name for r in self.rewards]
        check_against_model(opts, self.policy.config.max_position_embeddings, names)
        # beta > 0: a frozen copy of the starting policy for the KL term (with LoRA, the base: adapters off)
        self.ref_model = (copy.deepcopy(self.policy).requires_grad_(False).eval()
                          if opts.loss.beta != 0.0 and peft_config is None else None)
        self.rollout = self._rollout_backend(rollout, lora=peft_config is not None)
        self.stop_token_ids = eos_token_ids(self.policy.config, self.tokenizer)
        self.accuracy_index = names.index(opts.evaluation.accuracy_reward) if opts.evaluation.accuracy_reward else 0
        self._build_phases()
        self.last_rollout: ScoredRollout | None = None  # for callbacks
        self._train_start = self._idle_since = None  # training's start; since when rlcu queued no GPU work
        self._sharding_times: dict[str, float] = {}  # FSDP's gather and reshard around the last rollout

    def _build_phases(self) -> None:
        """The loss type and advantage estimator (registered records, built-in or plugin), the run's counters, and
        the score and update phases built from them."""
        opts = self.options
        self.loss_kind = registry.loss_type(opts.loss.loss_type)
        self.advantage_estimator = registry.advantage_estimator(opts.loss.advantage_estimator)
        self.counters = Counters()
        self.scoring = Scoring(opts, self.rewards, self.tokenizer, self.advantage_estimator, host=self)
        self.update_phase = Update(opts, self.policy, self.ref_model, self.loss_kind, self.numerics, self.counters,
                                   self, self.rollout.on_weights_updated, self._fault)
        self.streamer = self._streamer() if opts.streaming.streaming else None

    def _streamer(self) -> Streamer:
        """Streaming GRPO (`streaming.py`): the rollout stream stays open across steps, on the run's sampling."""
        s, st = self.options.sampling, self.options.streaming
        if self.agent is not None or self.program is not None:
            raise ValueError("streaming runs single-turn completions; episodes (tools, environment_factory, agent) "
                             "run synchronously: set streaming=false")
        require(self.rollout, "streaming", "streaming", "use rollout: native, or set streaming=false")
        spec = getattr(self.policy, "lora_spec", None)
        if st.decode_steps_during_training and spec is not None and spec.lora_dropout:
            raise ValueError(f"decode_steps_during_training decodes while the policy trains, and lora_dropout="
                             f"{spec.lora_dropout} would then drop in the sampler too: set lora_dropout: 0, or "
                             "decode_steps_during_training: 0")
        return Streamer(self, s.num_generations, st.max_staleness, st.max_inflight_tasks,
                        self.options.model.score_during_generation, s.max_completion_length,
                        st.decode_steps_during_training)

    # ---- what the streamer asks of the module (streaming.Host) ----------------------------------------------
    def open_stream(self, max_sequences: int):
        """A rollout stream on the run's sampling, its pool sized for `max_sequences` (`streaming.py`)."""
        if is_sharded(self.policy):
            raise ValueError("streaming keeps the rollout open across steps, which FSDP's gather per rollout does "
                             "not: train with DDP, or set streaming=false")
        return self.rollout.open_stream(self.sampling_params(), max_sequences, self.options.sampling.max_prompt_length)

    def score_group(self, row: dict, completion_ids: list[list[int]]) -> ScoredRollout:
        """One group's scores (from the streamer's worker thread, score_during_generation)."""
        return self.scoring.score_completions([row], completion_ids)

    def before_weights_change(self) -> None:
        """The update's hook before each optimizer step: the decode steps beside training end first."""
        if self.streamer is not None:
            self.streamer.wait_beside()

    def stream_seed(self, batch: int) -> int:
        """The sampling seed of the batch-th admitted batch: the synchronous step's for the same step."""
        return self.options.sampling.seed * 1_000_003 + batch * 7919 + self.data_parallel_rank

    @classmethod
    def from_trl(cls, config, **arguments) -> "GRPOModule":
        """A module from a TRL `GRPOConfig` (or its fields as a mapping), with TRL's defaults for what it leaves
        out; `arguments` (model, rewards or reward_funcs, tokenizer, ...) as GRPOTrainer takes them. The trainer's
        and the data's part of the config: `rlcu.trl.translate`."""
        from rlcu.grpo.trl_config import translate

        translation = translate(config)
        for line in translation.lines:
            log.info("TRL config: %s", line)
        return cls(**{**translation.model, **arguments})

    def _add_lora(self, peft_config) -> None:
        """TRL's `peft_config`: LoRA adapters trained on the frozen base, inside the engine too."""
        if peft_config is None:
            return
        if self.options.loss.sync_ref_model:
            raise ValueError("sync_ref_model with peft_config: the reference is the base with the adapters off, which "
                             "does not move; train without one of them")
        if not self.policy.native:
            raise ValueError(f"peft_config: LoRA runs in rlcu's native families; {self.policy.config.model_type} runs "
                             "on the transformers fallback: train it in full, or merge adapters elsewhere")
        if getattr(self.policy, "pending_weights", None) is not None:
            raise ValueError("peft_config with low_cpu_mem_usage: the adapters are made on the loaded weights; set "
                             "low_cpu_mem_usage false (it serves tensor parallelism, which trains without LoRA)")
        add_lora(self.policy, peft_config)

    def _agents_and_rewards(self, tools, environment_factory, agent, rewards, reward_weights,
                            processing_classes=None) -> list[BoundReward]:
        """tools / environments (TRL's names): multi-turn episodes, run as a continuation of the rollout; an
        environment's `get_reward` joins the rewards. An agent program: episodes through the endpoint, and what
        the program returns joins the rewards as `agent`."""
        limits = self.options.agents
        self.program, self.program_workers = None, None
        if agent is not None:
            if tools or environment_factory is not None:
                raise ValueError("agent runs its own tools and environment: give agent, or tools / "
                                 "environment_factory, not both")
            fmt = (tool_format(limits.tool_format, self.tokenizer, self.options.sampling.chat_template_kwargs)
                   if getattr(self.tokenizer, "chat_template", None) else None)  # None: text episodes only
            program = load_program(agent)
            self.agent, self.program = None, AgentProgram(program, fmt, resolve_processes(limits.agent_processes,
                                                                                          program))
            if isinstance(rewards, tuple) and rewards == ("math_answer",):
                rewards = []  # left at the default: the program's returns are the reward
            return resolve_rewards(rewards, reward_weights, [BoundReward(agent_reward, "agent", 1.0)],
                                   processing_classes)
        if limits.agent_processes > 0:
            raise ValueError("agent_processes runs agent programs (agent: ...), and this run has none; tools and "
                             "environments run in the trainer's process (tool_isolation: process forks each tool "
                             "call): drop agent_processes")
        self.agent = AgentOptions.build(self.tokenizer, tools, environment_factory, limits.tool_format,
                                        limits.max_tool_calling_iterations,
                                        self.options.sampling.max_completion_length, limits.tool_timeout,
                                        limits.tool_result_max_chars, self.options.sampling.chat_template_kwargs,
                                        limits.tool_isolation)
        environments = self.agent.environments if self.agent else None
        environment_rewards = [BoundReward(fn, name, 1.0) for name, fn in (environments.rewards() if environments
                                                                             else [])]
        bound = resolve_rewards(rewards, reward_weights, environment_rewards, processing_classes)
        for reward in bound:  # TRL renders reward models' conversations with the run's chat_template_kwargs too
            if isinstance(reward.fn, RewardModel):
                reward.fn.template_kwargs = dict(self.options.sampling.chat_template_kwargs or {})
        return bound

    def _rollout_backend(self, spec, lora: bool):
        """The rollout backend, checked once against what the run asks of it (its declared capabilities), and the
        run's numerics, chosen once, checked once (the model's own refusal, say of a fallback family, names it
        first), then handed as a value to the engine (`bind`) and to the training forward (`update.py`)."""
        backend, opts = resolve_rollout(spec), self.options.model
        if not self.policy.native and capabilities_of(backend).native_models_only:
            log.info("%s has no native path: rollouts from the reference backend (the model's HF modules, over "
                     "rlcu's static cache where they allow it)", self.policy.config.model_type)
            backend = resolve_rollout("reference")
        if lora:
            require(backend, "lora", "peft_config (LoRA adapters)", "use rollout: native or rollout: reference")
        if opts.score_during_generation and (self.agent is not None or self.program is not None):
            raise ValueError("score_during_generation scores single-turn completions as they end; episodes (tools, "
                             "environment_factory, agent) are scored after the rollout: set "
                             "score_during_generation=false")
        if self.program is not None and self.options.agents.max_branches:
            require(backend, "spawns", "max_branches (an agent program's branches)",
                    "use rollout: native, or set max_branches=0")
        if opts.score_during_generation:
            require(backend, "on_finished", "score_during_generation",
                    "use rollout: native, or set score_during_generation=false")
        self.numerics = Numerics.EXACT if opts.exact_logprobs else Numerics.FAST
        self.policy.check_numerics(self.numerics)
        if opts.exact_logprobs:
            require(backend, "exact_numerics", "exact_logprobs", "use rollout: native")
            self.numerics = backend.exact_numerics()  # over an FP8 KV cache, the trainer reads FP8 keys too
        return backend

    @classmethod
    def _policy(cls, model, tokenizer, opts: ModelOptions):
        policy, tokenizer = cls._load(model, tokenizer, opts.dtype, opts.trust_remote_code, opts.low_cpu_mem_usage)
        if opts.cast_lm_head_to_fp32:
            if policy.logits_from_forward:
                raise ValueError(f"cast_lm_head_to_fp32 needs a model rlcu runs natively; {type(policy).__name__} "
                                 "computes its logits in its own forward: set cast_lm_head_to_fp32 false")
            policy.cast_lm_head_to_fp32()
        return policy, tokenizer

    @staticmethod
    def _load(model, tokenizer, dtype: str, trust_remote_code: bool = False, low_cpu_mem_usage: bool = False):
        if isinstance(model, nn.Module):
            if tokenizer is None:
                raise ValueError("a model given as a module needs its tokenizer too (tokenizer=...)")
            from transformers import PreTrainedModel

            if isinstance(model, PreTrainedModel):  # TRL's way: a transformers model object, trained as it is
                from rlcu.models.hf import HFCausalLM

                return HFCausalLM(model), tokenizer
            return model, tokenizer
        policy, loaded_tokenizer = load_model(model, dtype=dtype, trust_remote_code=trust_remote_code,
                                              low_cpu_mem_usage=low_cpu_mem_usage)
        if tokenizer is None and loaded_tokenizer is None:
            raise ValueError(f"{model} has no tokenizer: save one into the folder, or pass tokenizer=...")
        return policy, tokenizer if tokenizer is not None else loaded_tokenizer

    # ---- Lightning hooks -------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        loss, trainer = self.options.loss, self._attached_trainer()
        strategy = trainer.strategy if trainer else None
        if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
            raise ValueError(f"{type(strategy).__name__} wraps modules in a way the rollout engine cannot "
                             "run; for FSDP use rlcu's fsdp2 (Lightning's ModelParallelStrategy with fully_shard): "
                             "--trainer.strategy=fsdp2 (see docs/scaling.md)")
        if strategy is not None and not isinstance(strategy, ModelParallelStrategy):  # the models move whole
            what = "the policy" if self.ref_model is None else "the policy and its reference model"
            require_fits(weight_bytes(self.policy, self.ref_model), strategy.root_device, what)
        if self.world_size > 1 and loss.filter_zero_std_groups and not self.loss_kind.needs_num_items:
            # every rank must run the same backward passes, so filtered rows are masked, not removed; only a loss
            # over the global token count (dapo's) is then the same as removing them
            raise ValueError(f"filter_zero_std_groups with several processes (DDP) needs loss_type='dapo' (DAPO's "
                             f"own pairing, or another loss over the step's tokens), got {loss.loss_type!r}; use dapo "
                             "or turn the filter off")
        bind(self.rollout, self.policy, self.tokenizer, self.numerics)
        for reward in self.rewards:  # reward models score on the training device
            if isinstance(reward.fn, RewardModel):
                reward.fn.to(self.device)

    def configure_model(self) -> None:
        """Under Lightning's ModelParallelStrategy: tensor parallelism within each group of `tensor_parallel_size`
        ranks (`tensor_parallel.py`), then FSDP over the data-parallel ranks (`sharding.py`)."""
        mesh = self.device_mesh
        if mesh is None or mesh["tensor_parallel"].size() == 1:  # low_cpu_mem_usage: the weights come in here
            for model in (self.policy, self.ref_model):
                if model is not None:
                    load_pending(model, "cpu")  # Lightning then moves it, or FSDP shards it
        if mesh is None or is_sharded(self.policy):
            return
        if mesh["tensor_parallel"].size() > 1:
            self._split(mesh["tensor_parallel"])
            if mesh["data_parallel"].size() == 1:
                return
        dtype = next(self.policy.parameters()).dtype  # the compute dtype; the shards become fp32
        for model in (self.policy, self.ref_model):
            if model is not None:
                shard(model, mesh["data_parallel"], dtype)

    def _split(self, tp) -> None:
        """Each rank of the tensor-parallel group `tp` keeps its share of the heads and MLP columns."""
        if self.streamer is not None or self.agent is not None or self.program is not None:
            # the ranks' engines must take the same steps, and these admit work as it arrives in time
            raise ValueError("tensor parallelism runs synchronous single-turn rollouts: set streaming=false and "
                             "leave out tools, environment_factory and agent, or train with strategy fsdp2 or ddp")
        strategy = self.trainer.strategy
        for model in (self.policy, self.ref_model):
            if model is not None:
                parallelize(model, tp.get_group())
                if getattr(model, "pending_weights", None) is not None:  # low_cpu_mem_usage: a checkpoint's shares,
                    for turn in range(strategy.num_processes):  # read by one rank of each node at a time
                        if strategy.local_rank == turn:
                            load_pending(model, strategy.root_device)
                        strategy.barrier("rlcu-load-shares")
                elif model.device.type == "meta":  # built without memory (a model whole on no one GPU): the share
                    materialize(model, strategy.root_device)  # gets random weights, alike on all
        cfg = self.policy.config
        log.info("tensor parallelism: each of %d ranks holds %d attention heads, %d KV heads and %d MLP columns of "
                 "each layer", tp.size(), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)

    def on_fit_start(self) -> None:
        """Check every training prompt against the tokenizer before the first step, so data errors
        surface at set-up and never mid-run."""
        dm = getattr(self.trainer, "datamodule", None)
        rows = getattr(dm, "train_set", None)
        if rows is not None:
            self._check_training_prompts(rows)
        held_out = getattr(dm, "val_set", None)
        if held_out and self.options.evaluation.eval_at_start and self._evaluates_later():
            # the curve's first point, in the numerics of the later ones: Lightning enters the precision's
            # autocast around validation_step only, not around this hook
            with self.trainer.precision_plugin.forward_context():
                metrics = evaluation.evaluate_all(self, held_out, dm.val_batch_size)
            for logger in self.loggers:
                logger.log_metrics(metrics, step=0)

    def _check_training_prompts(self, rows) -> None:
        """Each prompt tokenized once, in chunks (a dataset of millions of rows holds one chunk's ids at a time),
        with a progress bar where that takes a while."""
        from tqdm.auto import tqdm

        chunks = rows.chunks() if isinstance(rows, RowView) else [list(rows)]
        long, start = 0, 0
        with tqdm(total=len(rows), desc="checking the training prompts", unit=" prompts",
                  disable=len(rows) < PROGRESS_ROWS or self.global_rank != 0) as bar:
            for chunk in chunks:
                ids = encode_prompts(self.tokenizer, [row["prompt"] for row in chunk],
                                     self.options.sampling.chat_template_kwargs)
                long += sum(self.check_prompt_length(len(self.nonempty(p, start + i)), start + i)
                            for i, p in enumerate(ids))
                start += len(chunk)
                bar.update(len(chunk))
        if long:
            log.warning("%d of %d training prompts are longer than max_prompt_length=%d and lose their start "
                        "(long_prompts=truncate_left)", long, len(rows), self.options.sampling.max_prompt_length)

    def _evaluates_later(self) -> bool:
        """Whether the run reaches a held-out evaluation: the point before training starts a curve, and a run
        that ends before its first evaluation (a one-step smoke test, say) has none to start."""
        t = self.trainer
        every, steps = t.val_check_interval, t.max_steps
        if t.limit_val_batches == 0 or (isinstance(every, int) and t.check_val_every_n_epoch is None
                                        and 0 < steps < every):
            log.info("no held-out evaluation before training: this run of %s steps ends before its first", steps)
            return False
        return True

    def on_train_start(self) -> None:
        self._train_start = self._idle_since = time.perf_counter()  # timing/elapsed, evaluation included
        self._apply_optimizer_options()

    def _apply_optimizer_options(self) -> None:
        """A resumed run restores the optimizer's and the schedule's state, learning rate and betas included:
        the options of this run (which may differ from the checkpoint's, set on the command line) win."""
        hp, opt, sched = self.options.optimizer, self.optimizers(), self.lr_schedulers()
        sched.base_lrs = [hp.learning_rate] * len(opt.param_groups)
        factor = sched.lr_lambdas[0](sched.last_epoch)
        for group in opt.param_groups:
            group.update(lr=hp.learning_rate * factor, initial_lr=hp.learning_rate, weight_decay=hp.weight_decay,
                         betas=hp.adam_betas, eps=hp.adam_epsilon)

    def configure_optimizers(self):
        hp = self.options.optimizer
        params = [p for p in self.policy.parameters() if p.requires_grad]
        # fp32 masters for bf16 weights (or none: master_weights); moments in fp32 or (adam_state_dtype) bf16; in
        # host memory when offloaded
        opt = MasterWeightAdamW(params, lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=hp.adam_betas,
                                eps=hp.adam_epsilon, state_dtype=STATE_DTYPES[hp.adam_state_dtype],
                                offload=hp.optimizer_offload, master_weights=hp.master_weights)
        split = split_parameters(self.policy, params)
        if split is not None:
            opt.tensor_parallel = (split, self.policy.tensor_parallel)
        max_steps, estimated = self.trainer.max_steps, self.trainer.estimated_stepping_batches
        # a run by epochs ends where Lightning estimates (TRL's schedules know their end the same way)
        total = max_steps if max_steps and max_steps > 0 else (int(estimated) if math.isfinite(estimated) else None)
        if not hp.lr_scheduler.startswith("constant") and total is None:
            raise ValueError(f"lr_scheduler={hp.lr_scheduler!r} needs trainer.max_steps (or max_epochs) to know where "
                             "it ends: set one, or lr_scheduler: constant for a run bounded by time alone")
        # transformers' own schedules, as TRL builds them
        schedule = get_scheduler(hp.lr_scheduler, opt, num_warmup_steps=hp.warmup(total), num_training_steps=total,
                                 scheduler_specific_kwargs=hp.lr_scheduler_kwargs or {})
        return [opt], [{"scheduler": schedule, "interval": "step"}]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rlcu_counters"] = asdict(self.counters)
        if self.streamer is not None:  # the prompts admitted and not trained: submitted again on resume
            checkpoint["rlcu_stream"] = self.streamer.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("state_dict", {})
        live = self.state_dict() if saved else {}  # once: both checks read it
        self._match_reference(saved, live)
        self._check_shapes(saved, live)
        for name, value in checkpoint.get("rlcu_counters", {}).items():  # in place: the update phase holds them
            setattr(self.counters, name, value)
        if self.streamer is not None and "rlcu_stream" in checkpoint:
            self.streamer.load_state_dict(checkpoint["rlcu_stream"])

    def _match_reference(self, saved: dict, live: dict) -> None:
        """A run resumed with another beta (Lightning resumes a run folder's last.ckpt by itself) goes on: where this
        run keeps no reference model, the checkpoint's is left out; where it keeps one and the checkpoint has none,
        the reference is this run's starting model, as it would have been from the first step. Any other tensor that
        one side has and the other lacks (adapters added or taken away) is one error naming it, before any copy."""
        if not saved:
            return
        reference = [k for k in saved if k.startswith("ref_model.")]
        if reference and self.ref_model is None:
            for key in reference:
                del saved[key]
            rank_zero_info("rlcu: the checkpoint's reference model is left out: this run keeps none (beta 0, or LoRA)")
        elif self.ref_model is not None and not reference:
            saved.update({k: v for k, v in live.items() if k.startswith("ref_model.")})
            rank_zero_info("rlcu: the checkpoint has no reference model: this run's starting model is the reference")
        missing, extra = [k for k in live if k not in saved], [k for k in saved if k not in live]
        if missing or extra:
            path = getattr(self._attached_trainer(), "ckpt_path", None) or "the checkpoint"
            which = (f"lacks {missing[0]}, which this run has" if missing else f"has {extra[0]}, which this run lacks")
            raise ValueError(f"{path} was saved by another set-up: it {which} ({len(missing)} such tensors missing, "
                             f"{len(extra)} extra); resume it with the settings it was trained with (peft_config, the "
                             "model), or start this run in another folder (--trainer.default_root_dir) or without "
                             "that checkpoint")

    def _check_shapes(self, saved: dict, live: dict) -> None:
        """A checkpoint of another model (a run folder's last.ckpt, resumed by Lightning, after the recipe's model was
        changed) is one error that says so, before its tensors are copied in. A tensor-parallel share is smaller
        than the whole tensor the file holds, and is left to the split's own loading."""
        split = set()
        for prefix, model in (("policy.", self.policy), ("ref_model.", self.ref_model)):
            tp = getattr(model, "tensor_parallel", None)
            split |= {prefix + k for k in tp.split_tensors(model)} if tp is not None else set()
        for key, value in saved.items():
            if key in live and key not in split and tuple(value.shape) != tuple(live[key].shape):
                path = getattr(self._attached_trainer(), "ckpt_path", None) or "the checkpoint"
                raise ValueError(f"{path} holds another model: its {key} is {tuple(value.shape)}, this model's "
                                 f"{tuple(live[key].shape)}; resume it with the model it was trained from, or start "
                                 "this one in another folder (--trainer.default_root_dir) or without that checkpoint")

    def on_validation_start(self) -> None:
        if self.streamer is not None:  # evaluation generates on the engine; the pending prompts go in again after
            self.streamer.close()

    def on_validation_end(self) -> None:
        if self._idle_since is not None:  # evaluation kept the GPU busy: timing/idle counts from its end
            self._idle_since = self._now()

    def on_train_end(self) -> None:
        if self.streamer is not None:
            self.streamer.close()

    def validation_step(self, batch, batch_idx):
        rows = as_rows(batch)
        sync = self.world_size > 1  # each rank holds a share of the rows
        for name, value in evaluation.evaluate(self, rows).items():
            self.log(name, value, batch_size=len(rows), on_epoch=True, prog_bar=name == "eval/accuracy", sync_dist=sync)
        for name, value in (("step", self.global_step), ("epoch", self.current_epoch)):  # as training logs them
            self.log(name, float(value), batch_size=len(rows), on_epoch=True, sync_dist=sync)

    # ---- one GRPO step ---------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        rows = as_rows(batch)
        if self.streamer is not None:
            return self._streaming_step(rows)
        self.scoring.new_step()
        t0 = self._now()
        self._peak_memory_gb()  # starts the generate phase's window
        with self.scoring.early_scorer(rows) as scorer:
            with record_function("rlcu/generate"):  # the phases, for `rlcu bench step --profile`
                rollout = self._rollout(rows, scorer)
            t1 = self._now()
            early = {} if scorer is None else {"scored_during_generation": scorer.rows_scored / len(rollout.batch)}
            self._score_and_update(rows, rollout, scorer, (t0, t1), early)
        return None

    def _streaming_step(self, rows: list[dict]):
        """Streaming GRPO: admit the rows; once the stream is full, train on the groups that finished first."""
        t0 = self._now()
        self._peak_memory_gb()
        was_training = self.policy.training
        self.policy.eval()
        try:
            with record_function("rlcu/generate"):
                taken = self.streamer.step(rows, self.global_step, self.stop_requested)
        except GenerationInterrupted as e:
            log.warning("%s; stopping", e)
            raise SIGTERMException from e
        finally:
            if not self.streamer.beside_steps:  # else the pool stays for the decode steps beside training
                self.rollout.release()  # the sequences in flight are recomputed after the update (release_memory)
            self.policy.train(was_training)
        if taken is None:  # the stream fills: no optimizer step yet, and the engine decoded all along
            self._idle_since = self._now()
            return None
        self.streamer.decode_beside()
        try:
            self.scoring.new_step()
            self._score_and_update(taken.rows, taken.sampled, taken.scorer, (t0, self._now()), taken.metrics)
        finally:
            self.streamer.wait_beside()
        self.streamer.updated(self.global_step)
        return None

    def _score_and_update(self, rows: list[dict], rollout: Sampled, scorer: EarlyScorer | Prescored | None,
                          times: tuple[float, float], metrics: dict[str, float]) -> None:
        """The score and update phases of a step whose rollout took `times` (start, end)."""
        t0, t1 = times
        memory = {"memory/generate_GB": self._peak_memory_gb()}
        try:
            with record_function("rlcu/score"):
                scored, grpo_batch, keep, step_metrics = self.scoring(rows, rollout, scorer)
        except NonFiniteReward as e:  # a numerical fault: this batch teaches nothing trustworthy
            self._log_metrics(self._fault(str(e)))
            return
        metrics = {**step_metrics, **metrics}
        t2 = self._now()
        with record_function("rlcu/train"):
            metrics.update(self.update_phase(grpo_batch, keep) if keep.any() else self._skip())
        self._sync_reference()
        t3 = self._now()
        memory["memory/train_GB"] = self._peak_memory_gb()  # scoring and training
        metrics.update({k: v for k, v in memory.items() if v is not None})
        gen_tokens = int(grpo_batch.lengths.sum())
        metrics.update({"timing/generate": t1 - t0, "timing/score": t2 - t1, "timing/train": t3 - t2,
                        "timing/idle": self._idle_seconds(t0, t1, t2), "tokens_per_second": gen_tokens /
                        max(t1 - t0, 1e-9), "num_tokens": float(gen_tokens),
                        "timing/elapsed": t3 - (self._train_start or t0)})
        self._idle_since = t3
        metrics.update({f"timing/{k}": v for k, v in self._sharding_times.items()})
        self._log_metrics(metrics)
        self.last_rollout = scored

    def _idle_seconds(self, t0: float, t1: float, t2: float) -> float:
        """Seconds of this step in which rlcu had no GPU work queued: from the end of the previous step (or of an
        evaluation) to this step's start (Lightning's loop, the data loader), and the score phase unless a reward
        model scores on the GPU. Streaming's waits for finished groups are not idle: the engine decodes then."""
        gap = t0 - self._idle_since if self._idle_since is not None else 0.0
        gpu_reward = any(isinstance(r.fn, RewardModel) for r in self.rewards) and self.device.type == "cuda"
        return max(gap, 0.0) + (0.0 if gpu_reward else t2 - t1)

    def _sync_reference(self) -> None:
        """TRL's `sync_ref_model` (TR-DPO): every ref_model_sync_steps optimizer steps, the reference moves toward
        the policy: ref = alpha x policy + (1 - alpha) x ref."""
        loss = self.options.loss
        if not loss.sync_ref_model or self.ref_model is None or self.global_step % loss.ref_model_sync_steps:
            return
        with torch.no_grad():
            for ref, live in zip(self.ref_model.parameters(), self.policy.parameters(), strict=True):
                ref.mul_(1.0 - loss.ref_model_mixup_alpha).add_(live.to(ref.dtype), alpha=loss.ref_model_mixup_alpha)

    def _rollout(self, rows: list[dict], scorer: EarlyScorer | None = None) -> Sampled:
        s = self.options.sampling
        sampling = self.sampling_params(seed=s.seed * 1_000_003 + self.global_step * 7919 + self.data_parallel_rank)
        return self.sample(rows, s.num_generations, sampling, None if scorer is None else scorer.on_finished)

    # ---- the phases' public parts (held-out evaluation uses them too) ------------------------------
    def sampling_params(self, seed: int | None = None, greedy: bool = False) -> SamplingParams:
        """The run's sampling settings (greedy: temperature 0, for evaluation)."""
        return self.options.sampling.params(self.stop_token_ids, seed, greedy)

    def sample(self, rows: list[dict], g: int, sampling: SamplingParams,
               on_finished: Callable[[Turn], None] | None = None) -> Sampled:
        """`g` completions per row, adjacent; with tools or environments, `g` episodes per row. `on_finished`
        (single-turn only): told of each completion as it ends, on a backend that reports them."""
        if self.program is not None:
            return self._sample_programs(rows, g, sampling)
        if self.agent is None:
            prompt_ids = self.encode_rows(rows)
            return Sampled(self.generate([ids for ids in prompt_ids for _ in range(g)], sampling,
                                         on_finished=on_finished))
        trainer = self._attached_trainer()
        runner = EpisodeRunner([r for r in rows for _ in range(g)], self.agent,
                               (lambda: trainer.received_sigterm) if trainer else None)
        for i, ids in enumerate(runner.prompt_ids[::g]):
            self.check_prompt_length(len(ids), i)
        try:
            return Sampled(self.generate(runner.prompt_ids, sampling, runner), runner.record())
        except CallInterrupted as e:  # SIGTERM while a tool hangs: stop as Lightning stops on SIGTERM
            log.warning("%s; stopping", e)
            raise SIGTERMException from e

    def _sample_programs(self, rows: list[dict], g: int, sampling: SamplingParams) -> Sampled:
        """`g` episodes per row of the agent program, each through the endpoint, which stops with the rollout."""
        limits, s, agent = self.options.agents, self.options.sampling, self.program
        runner = ProgramRunner([r for r in rows for _ in range(g)], agent.program, agent.format,
                               self.policy.config.model_type, s.max_completion_length, limits.agent_timeout,
                               self.tokenizer, limits.agent_history, limits.max_branches, s.max_prompt_length,
                               self._program_workers())
        try:
            for i, ids in enumerate(runner.prompt_ids[::g]):
                self.check_prompt_length(len(ids), i)
            # each call's own max_tokens bounds what it samples, within max_call_tokens
            batch = self.generate(runner.prompt_ids, replace(sampling, max_turn_tokens=limits.max_call_tokens,
                                                             first_turn_tokens=runner.first_turn_tokens), runner)
            return Sampled(batch, runner.record())
        finally:
            runner.close()

    def _program_workers(self) -> ProgramWorkers | None:
        """The worker processes of `agent_processes`, started at the first rollout and kept until teardown."""
        if self.program.processes and self.program_workers is None:
            self.program_workers = ProgramWorkers(self.program.processes)
        return self.program_workers

    def teardown(self, stage: str) -> None:
        if self.program_workers is not None:
            self.program_workers.close()
            self.program_workers = None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 continuation: Continuation | None = None,
                 on_finished: Callable[[Turn], None] | None = None) -> RolloutBatch:
        """A rollout on the policy in eval mode; the backend's memory is given back for training after. A
        backend that cannot run episodes itself runs them turn by turn (`rollout/turns.py`)."""
        was_training = self.policy.training
        self.policy.eval()
        try:
            # FSDP: the whole model for the rollout, sharded again after (timing/gather, timing/reshard)
            with full_parameters(self.policy, self._sharding_times, self._now):
                return turns.generate(self.rollout, prompt_ids, sampling, continuation, on_finished,
                                      should_stop=self.stop_requested)
        except GenerationInterrupted as e:  # SIGTERM or Ctrl-C mid-rollout: stop as Lightning stops on SIGTERM
            log.warning("%s; stopping", e)
            raise SIGTERMException from e
        finally:
            self.rollout.release()
            self.policy.train(was_training)

    def encode_rows(self, rows: list[dict]) -> list[list[int]]:
        """The rows' prompts' token ids, each fitted to max_prompt_length."""
        return [self.fit_prompt(ids, i) for i, ids in enumerate(encode_prompts(
            self.tokenizer, [r["prompt"] for r in rows], self.options.sampling.chat_template_kwargs))]

    def encode(self, prompt, index: int) -> list[int]:
        """A prompt's token ids; one over max_prompt_length is an error or keeps its end (long_prompts)."""
        return self.fit_prompt(encode_prompt(self.tokenizer, prompt, self.options.sampling.chat_template_kwargs),
                               index)

    def fit_prompt(self, ids: list[int], index: int) -> list[int]:
        ids = self.nonempty(ids, index)
        if self.check_prompt_length(len(ids), index):
            ids = ids[-self.options.sampling.max_prompt_length:]  # the end holds the question and the generation prompt
        return ids

    @staticmethod
    def nonempty(ids: list[int], index: int) -> list[int]:
        if not ids:
            raise ValueError(f"prompt {index} encodes to no tokens")
        return ids

    def check_prompt_length(self, length: int, index: int) -> bool:
        """Whether the prompt is over max_prompt_length (an error unless long_prompts=truncate_left)."""
        limit = self.options.sampling.max_prompt_length
        if length > limit and (self.options.sampling.long_prompts == "error" or self.agent is not None):
            raise ValueError(f"prompt {index} has {length} tokens, more than max_prompt_length={limit}; raise "
                             "max_prompt_length, shorten the prompt"
                             + ("" if self.agent else ", or set long_prompts=truncate_left"))
        return length > limit

    # ---- faults, logging, timing -----------------------------------------------------------------
    def _skip(self) -> dict[str, float]:
        """Every group had zero reward variance and was filtered: no update, so no optimizer step."""
        self.counters.consecutive_skips += 1
        if self.counters.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise TrainingFault(f"{self.counters.consecutive_skips} batches in a row had zero reward variance in every "
                               "group, so filter_zero_std_groups left nothing to train on; check that the rewards can "
                               "tell completions apart, or set filter_zero_std_groups=false")
        return {"skipped_updates": 1.0}

    def _fault(self, what: str) -> dict[str, float]:
        """Skip this update, say why, count it; too many in a row stop the run."""
        c, limit = self.counters, self.options.faults.max_consecutive_faults
        c.faults += 1
        c.consecutive_faults += 1
        if c.consecutive_faults >= limit:
            raise TrainingFault(f"{c.consecutive_faults} updates in a row were skipped for numerical faults, the "
                               f"last: {what}. Lower the learning rate, check the rewards, or train in a wider dtype "
                               f"(max_consecutive_faults={limit})")
        log.warning("step %d: update skipped: %s", self.global_step, what)
        return {"faults/skipped_updates": float(c.faults)}

    # ---- what the phases ask of the module (score_phase.Host, update.Host) --------------------------
    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(value, reduce_op="sum")

    def stop_requested(self) -> bool:
        """SIGTERM reached the run (Lightning's flag): rewards and tools that wait give up."""
        trainer = self._attached_trainer()
        return bool(trainer and trainer.received_sigterm)

    def trainer_state(self) -> TrainerState:
        """TRL passes `trainer_state` to rewards for schedules that depend on progress."""
        trainer = self._attached_trainer()
        if trainer is None:
            return TrainerState(self.global_step)
        return TrainerState(self.global_step, trainer.max_steps, float(self.current_epoch), trainer.max_epochs or -1,
                            trainer.is_global_zero, trainer.local_rank == 0)

    @property
    def world_size(self) -> int:
        trainer = self._attached_trainer()
        return trainer.world_size if trainer else 1

    @property
    def data_parallel_rank(self) -> int:
        """This process's rank among those with their own rows (seeds differ by it); tensor-parallel ranks share
        theirs, and sample the same tokens from the same seed."""
        return data_parallel_rank(self._attached_trainer())[0]

    def _attached_trainer(self):
        """The trainer, or None outside one (Lightning's `trainer` property raises there)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        shown = {"reward", "tokens_per_second"}
        sync = self.world_size > 1  # mean over ranks
        # NaN (e.g. the std of one sample) is dropped, except under sync, where every rank must log every key
        clean = {k: v for k, v in metrics.items()
                 if v is not None and (sync or not (isinstance(v, float) and math.isnan(v)))}
        # the logged step is the optimizer steps taken so far, as TRL logs it and the completions table numbers its
        # rows (Lightning's own count starts at 0, where the evaluation before training is logged)
        clean.update(step=float(self.global_step), epoch=float(self.current_epoch))
        self.log_dict({k: v for k, v in clean.items() if k not in shown}, on_step=True, prog_bar=False, sync_dist=sync,
                      batch_size=1)
        self.log_dict({k: clean[k] for k in shown if k in clean}, on_step=True, prog_bar=True, batch_size=1,
                      sync_dist=sync)

    def _peak_memory_gb(self) -> float | None:
        """Peak GPU memory since the previous call, in GB (then the window restarts); None off CUDA."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device) / 1e9
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


# the flat options as keywords with their types, defaults and help, generated from their one definition
GRPOModule.__init__.__signature__, GRPOModule.__init__.__doc__ = signature(GRPOModule.__init__)
