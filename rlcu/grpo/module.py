"""GRPOModule: GRPO (and its DAPO / Dr. GRPO / GSPO variants) as a Lightning module with manual
optimization. One `training_step` is one GRPO step:

    generate G completions per prompt (rollout backend, on this module's own parameters)
    -> score them (reward plugins) -> group advantages
    -> num_iterations x [micro-batched forward/backward, clip, optimizer step, LR schedule]

Options keep TRL's names and meanings. The maths are the pure functions of `loss.py`."""
from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.profiler import record_function

from rlcu import plugins, strategies  # noqa: F401  (strategies: registers --trainer.strategy=fsdp2)
from rlcu.data.prompts import as_rows, decode_completions, encode_prompt, is_conversational
from rlcu.grpo import loss as grpo_loss
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.hparams import not_plain
from rlcu.grpo.evaluation import HeldOutEvaluation
from rlcu.grpo.metrics import LossStats, completion_metrics, reward_metrics
from rlcu.grpo.optim import MasterWeightAdamW
from rlcu.models import CausalLM, load_model
from rlcu.models.sharding import full_parameters, is_sharded, shard
from rlcu.rewards.base import NonFiniteReward, resolve_rewards
from rlcu.rewards.scoring import ON_ERROR, score
from rlcu.rollout.base import RolloutBackend, RolloutBatch, SamplingParams
from rlcu.contracts import eos_token_ids

log = logging.getLogger(__name__)
SCHEDULES = ("constant", "linear", "cosine")
LONG_PROMPTS = ("error", "truncate_left")
# num_iterations > 1 needs the sampling-time logprobs: recomputed by a forward pass ("trainer"), or the ones
# the engine returned with its samples ("engine": no extra pass; logprob_mismatch/* says how far they are)
OLD_LOGPROBS = ("trainer", "engine")  # a prompt over max_prompt_length: stop at set-up, or keep its end
MAX_CONSECUTIVE_SKIPS = 20  # batches in a row with no learning signal before the run stops


def resolve_rollout(spec) -> RolloutBackend:
    """A backend from an instance, a short name / import path, or {name | class_path, init_args}."""
    backend, _ = plugins.build("rollouts", spec)
    if not isinstance(backend, RolloutBackend):
        raise TypeError(f"{type(backend).__name__} is not a rollout backend: it needs setup(module), "
                        "generate(prompt_token_ids, sampling), release() and on_weights_updated()")
    return backend


class GRPOModule(HeldOutEvaluation, L.LightningModule):
    def __init__(
        self,
        model: str | CausalLM = "smollm2-135m-instruct",
        tokenizer: Any = None,
        rewards: Any = ("math_answer",),
        reward_weights: list[float] | None = None,
        rollout: Any = "native",
        num_generations: int = 8,
        max_prompt_length: int = 512,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        stop: list[str] | None = None,
        loss_type: str = "dapo",
        importance_sampling_level: str = "token",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        num_iterations: int = 1,
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        filter_zero_std_groups: bool = False,
        micro_batch_size: int = 8,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        lr_scheduler: str = "constant",
        warmup_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        packing: bool = False,
        seed: int = 0,
        eval_num_samples: int = 4,
        accuracy_reward: str | None = None,
        eval_at_start: bool = True,
        max_consecutive_faults: int = 3,
        reward_timeout: float | None = None,
        on_reward_error: str = "raise",
        long_prompts: str = "error",
        old_logprobs: str = "trainer",
    ):
        super().__init__()
        self.save_hyperparameters(ignore=not_plain(model=model, tokenizer=tokenizer, rewards=rewards, rollout=rollout))
        self._check_options(loss_type, importance_sampling_level, scale_rewards, lr_scheduler, num_generations,
                            micro_batch_size, num_iterations, epsilon, max_completion_length)
        self.automatic_optimization = False
        if isinstance(model, nn.Module):
            if tokenizer is None:
                raise ValueError("a model given as a module needs its tokenizer too (tokenizer=...)")
            self.policy, self.tokenizer = model, tokenizer
        else:
            self.policy, self.tokenizer = load_model(model, dtype=dtype)
            if tokenizer is not None:
                self.tokenizer = tokenizer
        self.policy.gradient_checkpointing = gradient_checkpointing
        context = self.policy.config.max_position_embeddings
        if max_prompt_length + max_completion_length > context:
            raise ValueError(f"max_prompt_length + max_completion_length = {max_prompt_length + max_completion_length} "
                             f"exceeds the model's context of {context} tokens; lower one of them")
        self.ref_model = None
        if beta != 0.0:  # frozen copy of the starting policy for the KL term
            self.ref_model = copy.deepcopy(self.policy).requires_grad_(False).eval()
        self.rewards = resolve_rewards(rewards, reward_weights)
        self.rollout = resolve_rollout(rollout)
        self.stop_token_ids = eos_token_ids(self.policy.config, self.tokenizer)
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        names = [r.name for r in self.rewards]
        if old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS}, got {old_logprobs!r}")
        if long_prompts not in LONG_PROMPTS:
            raise ValueError(f"long_prompts must be one of {LONG_PROMPTS}, got {long_prompts!r}")
        if on_reward_error not in ON_ERROR:
            raise ValueError(f"on_reward_error must be one of {ON_ERROR}, got {on_reward_error!r}")
        if reward_timeout is not None and reward_timeout <= 0:
            raise ValueError(f"reward_timeout must be a positive number of seconds or null, got {reward_timeout}")
        if max_consecutive_faults < 1:
            raise ValueError(f"max_consecutive_faults must be >= 1, got {max_consecutive_faults}")
        if eval_num_samples < 0:
            raise ValueError(f"eval_num_samples must be >= 0 (0 or 1: greedy only), got {eval_num_samples}")
        if accuracy_reward is not None and accuracy_reward not in names:
            raise ValueError(f"accuracy_reward {accuracy_reward!r} is not one of this run's rewards {names}")
        self.accuracy_index = names.index(accuracy_reward) if accuracy_reward else 0

    @staticmethod
    def _check_options(loss_type, level, scale, schedule, g, mb, iters, eps, max_len):
        for value, allowed, name in ((loss_type, grpo_loss.LOSS_TYPES, "loss_type"), (level, grpo_loss.LEVELS, "importance_sampling_level"),
                                     (scale, grpo_loss.SCALES, "scale_rewards"), (schedule, SCHEDULES, "lr_scheduler")):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if g < 2:
            raise ValueError(f"num_generations must be >= 2 (GRPO compares completions within a group), got {g}")
        if mb < 1 or iters < 1 or max_len < 1 or eps < 0:
            raise ValueError("micro_batch_size, num_iterations and max_completion_length must be >= 1, epsilon >= 0")

    # ---- Lightning hooks -------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        hp = self.hparams
        strategy = type(getattr(self._trainer, "strategy", None)).__name__
        if strategy in ("FSDPStrategy", "DeepSpeedStrategy"):
            raise ValueError(f"{strategy} wraps modules in a way the rollout engine cannot "
                             "run; for FSDP use rlcu's fsdp2 (Lightning's ModelParallelStrategy with fully_shard): "
                             "--trainer.strategy=fsdp2 (see docs/scaling.md)")
        if self._world_size > 1 and hp.filter_zero_std_groups and hp.loss_type != "dapo":
            # every rank must run the same backward passes, so filtered rows are masked, not removed; only
            # dapo's loss (a token sum over the global token count) is then the same as removing them
            raise ValueError(f"filter_zero_std_groups with several processes (DDP) needs loss_type='dapo' (DAPO's "
                             f"own pairing), got {hp.loss_type!r}; use dapo or turn the filter off")
        self.rollout.setup(self)

    def configure_model(self) -> None:
        """Under Lightning's ModelParallelStrategy: FSDP over the data-parallel ranks (`sharding.py`)."""
        mesh = self.device_mesh
        if mesh is None or is_sharded(self.policy):
            return
        if mesh["tensor_parallel"].size() > 1:
            raise ValueError("rlcu shards its models with FSDP only: set ModelParallelStrategy's "
                             "tensor_parallel_size=1 (data_parallel_size is the number of ranks)")
        dtype = next(self.policy.parameters()).dtype  # the compute dtype; the shards become fp32
        for model in (self.policy, self.ref_model):
            if model is not None:
                shard(model, mesh["data_parallel"], dtype)

    def on_fit_start(self) -> None:
        """Check every training prompt against the tokenizer before the first step, so data errors
        surface at set-up and never mid-run."""
        dm = getattr(self.trainer, "datamodule", None)
        rows = getattr(dm, "train_set", None)
        if rows is not None:
            long = sum(len(self._encode(row["prompt"], i, truncate=False)) > self.hparams.max_prompt_length
                       for i, row in enumerate(rows))
            if long:
                log.warning("%d of %d training prompts are longer than max_prompt_length=%d and lose their start "
                            "(long_prompts=truncate_left)", long, len(rows), self.hparams.max_prompt_length)
        held_out = getattr(dm, "val_set", None)
        if held_out and self.hparams.eval_at_start:  # the curve's first point: the model before any update
            self._log_eval_at_start(held_out, dm.batch_size)

    def on_train_start(self) -> None:
        self._train_start = time.perf_counter()  # for timing/elapsed: curves against wall time, evaluation included

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.policy.parameters() if p.requires_grad]
        low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
        optimizer = MasterWeightAdamW if low_precision else torch.optim.AdamW  # fp32 updates for bf16 weights
        # fused on the GPU: one kernel, none of the foreach implementation's parameter-sized temporaries
        fused = all(p.is_cuda for p in params) or None
        opt = optimizer(params, lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=tuple(hp.adam_betas),
                        fused=fused)
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps and self.trainer.max_steps > 0 else None
        if hp.lr_scheduler != "constant" and total is None:
            raise ValueError(f"lr_scheduler={hp.lr_scheduler!r} needs trainer.max_steps to know where it ends")

        def factor(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / (hp.warmup_steps + 1)
            if hp.lr_scheduler == "constant":
                return 1.0
            progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
            return 1.0 - progress if hp.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor), "interval": "step"}]

    def trainer_state(self) -> dict:
        """TRL passes `trainer_state` to rewards for schedules that depend on progress."""
        max_steps = self.trainer.max_steps if self._trainer is not None else -1
        return {"global_step": self.global_step, "max_steps": max_steps, "epoch": self.current_epoch}

    # ---- one GRPO step ---------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        hp = self.hparams
        rows = as_rows(batch)
        g = hp.num_generations
        t0 = self._now()
        self._peak_memory_gb()  # starts the generate phase's window
        prompt_ids = [self._encode(r["prompt"], i) for i, r in enumerate(rows)]
        sampling = self._sampling(seed=hp.seed * 1_000_003 + self.global_step * 7919 + self.global_rank)
        with record_function("rlcu/generate"):  # the phases, for `rlcu bench step --profile`
            rollout = self._generate([ids for ids in prompt_ids for _ in range(g)], sampling)
        t1 = self._now()
        memory = {"memory/generate_GB": self._peak_memory_gb()}

        try:
            with record_function("rlcu/score"):
                rewards_per_func, completions = self._score(rows, rollout)
        except NonFiniteReward as e:  # a numerical fault: this batch teaches nothing trustworthy
            self._log_metrics(self._fault(str(e)))
            return None
        weights = torch.tensor([r.weight for r in self.rewards])
        rewards = grpo_loss.combine_rewards(rewards_per_func, weights)
        advantages, _, is_std_zero = grpo_loss.group_advantages(rewards, g, hp.scale_rewards)
        t2 = self._now()

        batch_t = self._tensors(rollout, advantages)
        keep = torch.ones(len(rollout), dtype=torch.bool)
        if hp.filter_zero_std_groups:
            keep = ~is_std_zero
        metrics = reward_metrics(rewards_per_func, [r.name for r in self.rewards], rewards, is_std_zero)
        metrics.update(completion_metrics(batch_t["lengths"], batch_t["truncated"]))
        if self._world_size > 1 and hp.filter_zero_std_groups:
            # DDP: every rank runs the same micro-batches (each backward is a collective), so the filtered
            # rows stay and lose their loss mask; the step is skipped only when no rank kept anything
            batch_t["loss_mask"][~keep] = 0
            kept = self.trainer.strategy.reduce(keep.sum().to(self.device), reduce_op="sum")
            keep = torch.full_like(keep, bool(kept > 0))
        with record_function("rlcu/train"):
            metrics.update(self._update(batch_t, keep) if keep.any() else self._skip())
        t3 = self._now()
        memory["memory/train_GB"] = self._peak_memory_gb()  # scoring and training
        metrics.update({k: v for k, v in memory.items() if v is not None})
        gen_tokens = int(batch_t["lengths"].sum())
        metrics.update({"timing/generate": t1 - t0, "timing/score": t2 - t1, "timing/train": t3 - t2,
                        "tokens_per_second": gen_tokens / max(t1 - t0, 1e-9), "num_tokens": float(gen_tokens),
                        "timing/elapsed": t3 - getattr(self, "_train_start", t0)})
        self._log_metrics(metrics)
        self.last_rollout = dict(prompts=[r["prompt"] for r in rows for _ in range(g)], completions=completions,
                                 rewards=rewards_per_func, advantages=advantages)
        return None

    def _sampling(self, seed: int | None = None, greedy: bool = False) -> SamplingParams:
        """The run's sampling settings (greedy: temperature 0, for evaluation)."""
        hp = self.hparams
        return SamplingParams(max_tokens=hp.max_completion_length, temperature=0.0 if greedy else hp.temperature,
                              top_p=hp.top_p, top_k=hp.top_k, min_p=hp.min_p, stop_token_ids=self.stop_token_ids,
                              stop=list(hp.stop or []), seed=seed)

    def _generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """A rollout on the policy in eval mode; the backend's memory is given back for training after."""
        was_training = self.policy.training
        self.policy.eval()
        try:
            with full_parameters(self.policy):  # FSDP: the whole model for the rollout, sharded again after
                return self.rollout.generate(prompt_ids, sampling)
        finally:
            self.rollout.release()
            self.policy.train(was_training)

    def _encode(self, prompt, index: int, truncate: bool = True) -> list[int]:
        ids = encode_prompt(self.tokenizer, prompt)
        if not ids:
            raise ValueError(f"prompt {index} encodes to no tokens")
        limit = self.hparams.max_prompt_length
        if len(ids) > limit:
            if self.hparams.long_prompts == "error":
                raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_prompt_length={limit}; raise "
                                 "max_prompt_length, shorten the prompt, or set long_prompts=truncate_left")
            if truncate:
                ids = ids[-limit:]  # the end holds the question and the generation prompt
        return ids

    def _score(self, rows: list[dict], rollout: RolloutBatch, g: int | None = None):
        g = self.hparams.num_generations if g is None else g
        texts = decode_completions(self.tokenizer, rollout.completion_ids)
        prompts = [r["prompt"] for r in rows for _ in range(g)]
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                       for p, t in zip(prompts, texts)]
        keys = [k for k in rows[0] if k != "prompt"]
        columns = {k: [r.get(k) for r in rows for _ in range(g)] for k in keys}
        return score(self.rewards, prompts, completions, rollout.completion_ids, columns,
                     timeout=self.hparams.reward_timeout, on_error=self.hparams.on_reward_error,
                     trainer_state=self.trainer_state()), completions

    def _tensors(self, rollout: RolloutBatch, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Prompt left-padded and completion right-padded, as TRL lays them out."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        n, p = len(rollout), max(len(x) for x in rollout.prompt_ids)
        c = max(1, max(len(x) for x in rollout.completion_ids))
        prompt = torch.full((n, p), pad, dtype=torch.long)
        prompt_mask = torch.zeros(n, p, dtype=torch.long)
        completion = torch.full((n, c), pad, dtype=torch.long)
        completion_mask = torch.zeros(n, c, dtype=torch.long)
        sampler_logps = torch.zeros(n, c)
        for i, (pi, ci, lp) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids, rollout.logprobs)):
            prompt[i, p - len(pi):], prompt_mask[i, p - len(pi):] = torch.tensor(pi), 1
            if ci:
                completion[i, :len(ci)], completion_mask[i, :len(ci)] = torch.tensor(ci), 1
                sampler_logps[i, :len(ci)] = torch.tensor(lp)
        truncated = torch.tensor([r == "length" for r in rollout.finish_reasons])
        loss_mask = completion_mask.clone()
        if self.hparams.mask_truncated_completions:
            loss_mask[truncated] = 0
        return dict(input_ids=torch.cat([prompt, completion], 1), attention_mask=torch.cat([prompt_mask, completion_mask], 1),
                    loss_mask=loss_mask, advantages=advantages, sampler_logps=sampler_logps, truncated=truncated,
                    lengths=completion_mask.sum(1))

    def _skip(self) -> dict[str, float]:
        """Every group had zero reward variance and was filtered: no update, so no optimizer step."""
        self._skips = getattr(self, "_skips", 0) + 1
        if self._skips >= MAX_CONSECUTIVE_SKIPS:
            raise RuntimeError(f"{self._skips} batches in a row had zero reward variance in every group, so "
                               "filter_zero_std_groups left nothing to train on; check that the rewards can tell "
                               "completions apart, or set filter_zero_std_groups=false")
        return {"skipped_updates": 1.0}

    def _stage(self, b: dict, idx: torch.Tensor) -> dict:
        """The kept rows of the host batch, each tensor copied to the device once, from pinned memory and without
        waiting: the micro-batch loop then slices device tensors and queues no copy of its own (one from
        pageable memory can hold the host until the GPU has drained its queue). The attention mask stays on the
        host as well, where padding is detected."""
        keys = ("input_ids", "attention_mask", "loss_mask", "advantages", "sampler_logps")
        host = {k: b[k][idx] for k in keys}
        cuda = self.device.type == "cuda"
        staged = {k: v.pin_memory().to(self.device, non_blocking=True) if cuda else v for k, v in host.items()}
        staged["host_attention_mask"] = host["attention_mask"]
        staged["num_items"] = host["loss_mask"].sum().float()
        return staged

    def _micro_batches(self, n: int) -> list[slice]:
        mb = self.hparams.micro_batch_size
        return [slice(s, min(s + mb, n)) for s in range(0, n, mb)]

    def _logps(self, model, b: dict, rows: slice, grad: bool):
        """`b` from `_stage`: device tensors, and the attention mask on the host too (no device sync to
        find out whether the micro-batch is padded)."""
        padded = self.hparams.packing or not bool(b["host_attention_mask"][rows].all())
        ids, mask = b["input_ids"][rows], b["attention_mask"][rows] if padded else None
        with torch.set_grad_enabled(grad):
            return completion_logprobs(model, ids, mask, b["loss_mask"].shape[1], self.hparams.temperature,
                                       packed=self.hparams.packing)

    def _update(self, b: dict, keep: torch.Tensor) -> dict[str, float]:
        hp = self.hparams
        self._skips = 0
        b = self._stage(b, keep.nonzero()[:, 0])
        mbs = self._micro_batches(len(b["input_ids"]))
        old = ref = None
        if hp.num_iterations > 1 and hp.old_logprobs == "engine":
            old = b["sampler_logps"]
        elif hp.num_iterations > 1:  # the policy moves between iterations: freeze the sampling-time logprobs
            old = torch.cat([self._logps(self.policy, b, r, grad=False)[0] for r in mbs])
        if self.ref_model is not None:
            ref = torch.cat([self._logps(self.ref_model, b, r, grad=False)[0] for r in mbs])
        num_items = b["num_items"]
        loss_items = num_items  # dapo's normaliser: the step's completion tokens over every rank
        world = self._world_size
        if world > 1:  # DDP averages gradients, so each rank divides by the global count / world size
            loss_items = self.trainer.strategy.reduce(num_items.to(self.device), reduce_op="sum").cpu() / world
        opt, sched = self.optimizers(), self.lr_schedulers()
        stats, losses, grad_norms = LossStats(), [], []
        gap_sum = gap_max = torch.zeros((), device=self.device)  # device-side: no host wait per micro-batch
        for it in range(hp.num_iterations):
            opt.zero_grad()
            total = torch.zeros((), device=self.device)
            for rows in mbs:
                logps, entropy = self._logps(self.policy, b, rows, grad=True)
                mask = b["loss_mask"][rows].float()
                adv = b["advantages"][rows]
                old_lp = old[rows] if old is not None else logps.detach()
                ptl, coef, kl = grpo_loss.per_token_loss(logps, old_lp, adv, mask, hp.epsilon, self.epsilon_high,
                                                  hp.importance_sampling_level, ref[rows] if ref is not None else None, hp.beta)
                loss = grpo_loss.aggregate_loss(ptl, mask, hp.loss_type, hp.max_completion_length, len(mbs), loss_items)
                self.manual_backward(loss)
                total += loss.detach()
                if it == 0:  # sampler vs trainer logprobs of the same tokens under the same weights
                    gap = (logps.detach() - b["sampler_logps"][rows]).abs() * mask
                    gap_sum, gap_max = gap_sum + gap.sum(), torch.maximum(gap_max, gap.max())
                stats.add(mask, entropy, kl, *grpo_loss.clip_masks(coef, adv, hp.epsilon, self.epsilon_high))
            if isinstance(opt.optimizer, MasterWeightAdamW):
                opt.optimizer.load_grads()  # clip and measure the fp32 copies
            with_grads = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in with_grads]) if with_grads else torch.tensor(0.0)
            if hasattr(norm, "full_tensor"):  # FSDP: a DTensor holding each rank's partial norm
                norm = norm.full_tensor()
            grad_norms.append(float(norm))
            if not math.isfinite(grad_norms[-1]):
                # NaN/Inf in the logits or the loss reached the gradients (under DDP every rank sees the same
                # averaged gradients, so all ranks skip together): no step, the weights stay as they were
                opt.zero_grad()
                return self._fault(f"non-finite gradients (norm {grad_norms[-1]}): NaN or Inf in the logits or loss")
            if hp.max_grad_norm:  # with the norm measured above: no second pass over the gradients
                torch.nn.utils.clip_grads_with_norm_(with_grads, hp.max_grad_norm, norm)
            opt.step()
            opt.zero_grad()  # the fp32 gradients would otherwise sit through the next rollout
            sched.step()
            self.rollout.on_weights_updated()
            losses.append(float(total))
        out = stats.result()
        out.update(loss=sum(losses) / len(losses), grad_norm=sum(grad_norms) / len(grad_norms),
                   learning_rate=sched.get_last_lr()[0])
        out["logprob_mismatch/mean"] = float(gap_sum) / max(float(num_items), 1.0)
        out["logprob_mismatch/max"] = float(gap_max)
        self._consecutive_faults = 0
        out["faults/skipped_updates"] = float(self._num_faults)
        return out

    @property
    def _world_size(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    @property
    def _num_faults(self) -> int:
        return getattr(self, "_faults_total", 0)

    def _fault(self, what: str) -> dict[str, float]:
        """Skip this update, say why, count it; too many in a row stop the run."""
        self._faults_total = self._num_faults + 1
        self._consecutive_faults = getattr(self, "_consecutive_faults", 0) + 1
        limit = self.hparams.max_consecutive_faults
        if self._consecutive_faults >= limit:
            raise RuntimeError(f"{self._consecutive_faults} updates in a row were skipped for numerical faults, the "
                               f"last: {what}. Lower the learning rate, check the rewards, or train in a wider dtype "
                               f"(max_consecutive_faults={limit})")
        log.warning("step %d: update skipped: %s", self.global_step, what)
        return {"faults/skipped_updates": float(self._faults_total)}

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        shown = {"reward", "tokens_per_second"}
        sync = self._world_size > 1  # mean over ranks
        # NaN (e.g. the std of one sample) is dropped, except under sync, where every rank must log every key
        clean = {k: v for k, v in metrics.items()
                 if v is not None and (sync or not (isinstance(v, float) and math.isnan(v)))}
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
