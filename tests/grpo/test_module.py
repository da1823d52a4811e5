"""GRPOModule contracts: shared parameters, TRL rewards unchanged, metrics, and clear errors."""
import pytest
import torch

from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from rlcu.plugins import UnknownPluginError
from rlcu.rewards.base import RewardError
from rlcu.rollout import SamplingParams
from tests.helpers import CHAT_TEMPLATE, fit, match_target, tiny_hf_folder, toy_rows


def make(tiny, **kw):
    options = dict(rewards=[match_target], num_generations=4, max_completion_length=4, learning_rate=1e-2,
                   micro_batch_size=8, seed=0)  # a seed whose first groups' rewards differ on this tiny model
    options.update(kw)
    return GRPOModule(tiny[0], tokenizer=tiny[1], **options)


def test_rollout_runs_on_the_modules_own_parameters(tiny, tmp_path):
    module = make(tiny, learning_rate=0.5, max_grad_norm=None)
    module.setup("fit")
    assert module.rollout.model is module.policy
    ptrs = {n: p.data_ptr() for n, p in module.policy.named_parameters()}
    greedy = SamplingParams(max_tokens=6, temperature=0)
    prompts = [[1], [2, 3], [4, 5, 6]]
    before = module.rollout.generate(prompts, greedy).completion_ids
    fit(module, toy_rows(4), steps=1, log_dir=tmp_path)
    assert {n: p.data_ptr() for n, p in module.policy.named_parameters()} == ptrs  # updated in place, never copied
    assert module.rollout.model is module.policy
    assert module.rollout.generate(prompts, greedy).completion_ids != before  # the next rollout sees the new weights


def test_trl_reward_functions_run_unchanged(tiny, tmp_path):
    trl_rewards = pytest.importorskip("trl.rewards")
    module = make(tiny, rewards=[trl_rewards.think_format_reward,
                                 trl_rewards.get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)])
    metrics = fit(module, toy_rows(8, chat=True), steps=2, log_dir=tmp_path)
    names = {k for m in metrics for k in m}
    assert {"rewards/think_format_reward/mean", "rewards/soft_overlong_punishment_reward/mean"} <= names
    assert all(m["rewards/think_format_reward/mean"] == 0.0 for m in metrics if "reward" in m)  # no <think> in 4 tokens
    completions = module.last_rollout.completions
    assert isinstance(completions[0], list) and completions[0][0]["role"] == "assistant"  # TRL's conversational form


def test_metrics_carry_trl_names_and_timings(tiny, tmp_path):
    metrics = fit(make(tiny), toy_rows(8), steps=2, log_dir=tmp_path)
    # steps numbered by the optimizer steps taken, as TRL logs them and the completions table numbers its rows
    assert [(m["step"], m["epoch"]) for m in metrics if "reward" in m] == [(1.0, 0.0), (2.0, 0.0)]
    step = [m for m in metrics if "reward" in m][-1]
    # no GPU work of rlcu's: host-side scoring, and Lightning's loop between the steps (under a second here)
    assert step["timing/score"] <= step["timing/idle"] < step["timing/score"] + 1.0
    for name in ("reward", "reward_std", "rewards/match_target/mean", "frac_reward_zero_std", "completions/mean_length",
                 "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "entropy", "loss", "grad_norm", "learning_rate", "timing/generate", "timing/score", "timing/train",
                 "timing/idle",
                 "tokens_per_second", "logprob_mismatch/max", "sampling/importance_sampling_ratio/mean"):
        assert name in step, name
    assert step["logprob_mismatch/max"] < 1e-4  # sampler and trainer agree on the same weights
    # so TRL's default correction (sequence_mask) keeps every sequence at a ratio of 1
    assert abs(step["sampling/importance_sampling_ratio/min"] - 1) < 1e-3
    assert abs(step["sampling/importance_sampling_ratio/max"] - 1) < 1e-3
    assert 1 <= step["completions/mean_length"] <= 4


def test_mask_truncated_and_zero_std_filtering(tiny, tmp_path):
    def constant(prompts, completions, completion_ids, **kw):
        return [1.0] * len(completions)

    module = make(tiny, rewards=[constant], filter_zero_std_groups=True, mask_truncated_completions=True)
    before = [p.detach().clone() for p in module.policy.parameters()]
    metrics = fit(module, toy_rows(8), steps=-1, max_epochs=1, log_dir=tmp_path)
    assert len([m for m in metrics if "reward" in m]) == 2
    assert all(m.get("frac_reward_zero_std") == 1.0 for m in metrics if "reward" in m)
    assert any(m.get("skipped_updates") == 1.0 for m in metrics)  # every group filtered: nothing to learn from
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))


def test_a_reward_without_signal_stops_the_run_instead_of_looping(tiny, tmp_path):
    def constant(prompts, completions, completion_ids, **kw):
        return [0.0] * len(completions)

    with pytest.raises(RuntimeError, match="20 batches in a row had zero reward variance"):
        fit(make(tiny, rewards=[constant], filter_zero_std_groups=True), toy_rows(8), steps=5, log_dir=tmp_path)


def test_lr_schedule_warms_up_and_decays(tiny, tmp_path):
    module = make(tiny, lr_scheduler="linear", warmup_steps=2, learning_rate=1e-2)
    lrs = [m["learning_rate"] for m in fit(module, toy_rows(24), steps=6, log_dir=tmp_path) if "learning_rate" in m]
    # lr after each step's scheduler tick, by transformers' linear schedule (TRL's): its warm-up starts at 0
    expected = [1e-2 * f for f in (1 / 2, 1.0, 0.75, 0.5, 0.25, 0.0)]
    assert lrs == pytest.approx(expected)


def test_clear_errors(tiny, tmp_path):
    with pytest.raises(UnknownPluginError, match="unknown reward 'mth_answer'; available: .*math_answer"):
        make(tiny, rewards=["mth_answer"])
    with pytest.raises(UnknownPluginError, match="unknown rollout 'vllm'; available: .*reference"):
        make(tiny, rollout="vllm")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        make(tiny, loss_type="ppo")
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        make(tiny, num_generations=1)
    with pytest.raises(ValueError, match="exceeds the model's context of 1024 tokens"):
        make(tiny, max_prompt_length=1000, max_completion_length=100)
    with pytest.raises(ValueError, match="needs its tokenizer"):
        GRPOModule(tiny[0], rewards=[match_target])
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        make(tiny, vllm_importance_sampling_mode="token")
    with pytest.raises(ValueError, match="importance_sampling_mode and vllm_importance_sampling_mode are one option"):
        make(tiny, vllm_importance_sampling_mode="token_mask", importance_sampling_mode="sequence_truncate")
    assert make(tiny, loss_type="vespo").options.correction.mode == "sequence_mask"  # a TRL config carries over
    assert make(tiny, importance_sampling_mode="token_truncate").options.correction.mode == "token_truncate"
    assert not make(tiny, importance_sampling_correction=False).options.correction.enabled
    with pytest.raises(ValueError, match=r"prompt 0 has 5 tokens, more than max_prompt_length=3"):
        fit(make(tiny, max_prompt_length=3), [{"prompt": "t1 t2 t3 t4 t5", "target": 8}] * 4, 1, tmp_path)

    def broken(prompts, completions, completion_ids, **kw):
        raise RuntimeError("grader offline")

    with pytest.raises(RewardError, match="reward 'broken' raised RuntimeError: grader offline on sample 0"):
        fit(make(tiny, rewards=[broken]), toy_rows(4), 1, tmp_path)
    needs = "'math_answer' needs the dataset column 'answer'; the batch has \\['target'\\]"
    with pytest.raises(RewardError, match=needs):
        fit(make(tiny, rewards=["math_answer"]), toy_rows(4), 1, tmp_path)


def test_gradients_are_clipped_to_max_grad_norm(tmp_path):
    from tests.helpers import fit, match_target, toy_rows

    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, max_completion_length=4,
                        seed=0, learning_rate=1e-3, max_grad_norm=1e-3, adam_betas=(0.9, 0.999))
    metrics = fit(module, toy_rows(8), 1, tmp_path / "logs")
    raw = [m["grad_norm"] for m in metrics if "grad_norm" in m]
    assert len(raw) == 1 and raw[0] > 1e-3, raw  # the raw norm was above the limit...
    # ...and the step read the gradients clipped to it: after one step, exp_avg = (1 - beta1) * the clipped gradient
    opt = module.optimizers().optimizer
    moments = [opt.state[m]["exp_avg"] for m in opt.masters if m in opt.state]
    assert float(torch.linalg.vector_norm(torch.stack([t.norm() for t in moments]))) == pytest.approx(1e-4, rel=1e-3)


def test_a_checkpoint_of_another_model_is_one_error_before_its_tensors_load(tmp_path):
    """Lightning resumes a run folder's last.ckpt by itself (the recipe's interrupt checkpoint): after the recipe's
    model changed, the shapes differ, and the error says so instead of load_state_dict's list of mismatches."""
    reward = [lambda prompts, completions, completion_ids, **kw: [0.0] * len(prompts)]
    build = lambda folder: GRPOModule(str(folder), rewards=reward, num_generations=2,  # noqa: E731
                                      max_completion_length=4)
    module = build(tiny_hf_folder(tmp_path / "a", "llama"))
    same = {"state_dict": build(tiny_hf_folder(tmp_path / "b", "llama", seed=1)).state_dict()}
    module.on_load_checkpoint(same)  # other weights, same shapes: a checkpoint it can resume
    other = {"state_dict": build(tiny_hf_folder(tmp_path / "c", "llama", hidden=36)).state_dict()}
    with pytest.raises(ValueError, match=r"holds another model: its policy\.model\.embed_tokens\.weight is \(64, 36\), "
                                         r"this model's \(64, 48\); resume it with the model it was trained from"):
        module.on_load_checkpoint(other)


def test_a_checkpoint_resumed_with_another_beta_goes_on_and_other_missing_tensors_are_one_error(tmp_path):
    """`rlcu run RECIPE --model.beta=...` again in a run folder: Lightning resumes its last.ckpt, which has a reference
    model where this run keeps none, or none where this run keeps one; each used to stop in load_state_dict's
    traceback. Adapters added or taken away stay an error, one line naming a tensor."""
    reward = [lambda prompts, completions, completion_ids, **kw: [0.0] * len(prompts)]
    folder = tiny_hf_folder(tmp_path / "a", "llama")
    build = lambda **kw: GRPOModule(str(folder), rewards=reward, num_generations=2,  # noqa: E731
                                    max_completion_length=4, **kw)
    with_reference, without = build(beta=0.04), build()
    with torch.no_grad():  # a trained policy: the checkpoint's reference and policy differ from the start
        for p in with_reference.policy.parameters():
            p.add_(0.5)
    saved = {"state_dict": with_reference.state_dict()}
    assert any(k.startswith("ref_model.") for k in saved["state_dict"])
    without.on_load_checkpoint(saved)
    without.load_state_dict(saved["state_dict"])  # strict: the reference's tensors were left out
    assert torch.equal(without.policy.model.embed_tokens.weight, with_reference.policy.model.embed_tokens.weight)

    start = build(beta=0.04)
    reference = {k: v.clone() for k, v in start.ref_model.state_dict().items()}
    saved = {"state_dict": build().state_dict()}
    for v in saved["state_dict"].values():
        v.add_(1.0)  # the checkpoint's policy trained on without a reference
    start.on_load_checkpoint(saved)
    start.load_state_dict(saved["state_dict"])
    assert all(torch.equal(v, reference[k]) for k, v in start.ref_model.state_dict().items())  # the starting model
    assert not torch.equal(start.policy.model.embed_tokens.weight, start.ref_model.model.embed_tokens.weight)

    lora = build(peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    with pytest.raises(ValueError, match=r"^the checkpoint was saved by another set-up: it lacks policy\.\S*lora\S*, "
                                         r"which this run has \(\d+ such tensors missing, 0 extra\); resume it "
                                         r"with the settings it was trained with"):
        lora.on_load_checkpoint({"state_dict": build().state_dict()})


def test_fsdp1_and_deepspeed_are_refused_with_the_way_to_fsdp2(tmp_path):
    from lightning.pytorch.strategies import FSDPStrategy

    folder = tiny_hf_folder(tmp_path / "tiny", "llama")
    module = GRPOModule(str(folder), rewards=[lambda prompts, completions, completion_ids, **kw: [0.0] * len(prompts)],
                        num_generations=2, max_completion_length=4)

    class Trainer:
        strategy = FSDPStrategy()
        world_size = 2

    module._trainer = Trainer()
    with pytest.raises(ValueError, match="strategy=fsdp2"):
        module.setup("fit")


def test_packing_makes_the_same_update(tmp_path):
    """`packing=True` (the training forward without padding) against the padded forward: prompts and
    completions of different lengths, two steps, same weights within float32 summation order."""
    import lightning.pytorch as L

    from rlcu.data.module import PromptDataModule
    from tests.helpers import FixedRollout, G, token_value

    folder = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8)
    states = []
    for packing in (False, True):
        torch.manual_seed(0)
        module = GRPOModule(str(folder), rewards=[token_value], rollout=FixedRollout(), num_generations=G,
                            max_completion_length=4, learning_rate=1e-2, micro_batch_size=4, packing=packing)
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, PromptDataModule(toy_rows(16, seed=3), batch_size=4, seed=1))
        states.append({k: v.detach().clone() for k, v in module.policy.state_dict().items()})
    initial = load_model(folder)[0].state_dict()
    assert max((states[0][k] - initial[k]).abs().max().item() for k in initial) > 1e-3
    worst = max((states[0][k] - states[1][k]).abs().max().item() for k in initial)
    assert worst < 1e-5, f"packed training differs by {worst:.2e}"


def test_adaptive_entropy_control_moves_the_coefficient_each_step(tiny, tmp_path):
    """Skywork-OR1's controller: with the entropy below the target the coefficient rises by entropy_coef_delta
    each optimizer step (and is applied from the second step, once an entropy was measured)."""
    module = make(tiny, use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.005, entropy_target=100.0)
    metrics = fit(module, toy_rows(12), 3, tmp_path)
    assert [round(m["entropy_coef"], 6) for m in metrics if "entropy_coef" in m] == [0.015, 0.02, 0.025]
    assert module.counters.last_entropy < 100.0


def test_an_entropy_bonus_changes_the_update(tiny, tmp_path):
    """The bonus trains through the entropy (its gradient reaches the weights): same data, same seed, other weights."""
    def trained(**kw):
        model, tok = load_model(tiny_hf_folder(tmp_path / "m2", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                               head_dim=8))
        tok.chat_template = CHAT_TEMPLATE
        module = make((model, tok), **kw)
        fit(module, toy_rows(4), 1, tmp_path / str(len(kw)))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert not torch.allclose(trained(), trained(entropy_coef=0.5))


def test_the_sampler_correction_masks_sequences_the_sampler_scored_far_off(tiny, tmp_path):
    from rlcu.rollout.reference import ReferenceRollout

    class Skewed(ReferenceRollout):
        """Says its first sample of each call was 20x less likely per token than it was."""

        def generate(self, prompt_token_ids, sampling, **hooks):  # the capabilities it inherits: should_stop
            out = super().generate(prompt_token_ids, sampling, **hooks)
            out.logprobs[0] = [lp - 3.0 for lp in out.logprobs[0]]
            return out

    step = [m for m in fit(make(tiny, rollout=Skewed()), toy_rows(4), 1, tmp_path) if "reward" in m][-1]
    assert step["sampling/importance_sampling_ratio/min"] == 0.0  # masked: its ratio is over clip_max = 3
    assert abs(step["sampling/importance_sampling_ratio/max"] - 1) < 1e-3  # the rest agree with the trainer
    step = [m for m in fit(make(tiny, rollout=Skewed(), vllm_importance_sampling_correction=False), toy_rows(4), 1,
                           tmp_path / "off") if "reward" in m][-1]
    assert "sampling/importance_sampling_ratio/min" not in step and step["logprob_mismatch/max"] >= 3.0 - 1e-4


def bf16_step(tmp_path, **optimizer_options):
    """One GRPO step of a tiny bf16 llama with bf16 AdamW moments -> (its optimizer, the largest weight change)."""
    from tests.helpers import fit, match_target, toy_rows

    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8), dtype="bfloat16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, max_completion_length=4,
                        seed=0, learning_rate=1e-2, adam_state_dtype="bfloat16", **optimizer_options)
    fit(module, toy_rows(8), 1, tmp_path / "logs")
    moved = max((module.policy.state_dict()[k].float() - v.float()).abs().max().item() for k, v in before.items())
    return module.optimizers().optimizer, moved


def test_a_step_with_the_optimizer_state_offloaded_updates_the_model(tmp_path):
    opt, moved = bf16_step(tmp_path, optimizer_offload=True)
    assert opt.offload and all(m.device.type == "cpu" for m in opt.masters)
    assert moved > 1e-3
    assert all(torch.equal(m.to(torch.bfloat16), p.detach()) for m, p in zip(opt.masters, opt.model_params))


def test_a_step_without_master_weights_updates_the_bf16_weights_in_place(tmp_path):
    opt, moved = bf16_step(tmp_path, master_weights=False)
    assert all(m is p and p.dtype == torch.bfloat16 for m, p in zip(opt.masters, opt.model_params))
    assert moved > 1e-3


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.slow
@pytest.mark.parametrize("family,peft,kv", [("qwen3", None, "auto"),
                                            ("qwen3", {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"},
                                             "auto"),
                                            ("qwen3_moe", None, "auto"), ("qwen3", None, "fp8"),
                                            ("qwen3_5_text", None, "auto")],
                         ids=["full", "lora", "moe", "fp8-cache", "hybrid"])
def test_exact_logprobs_steps_with_no_mismatch_and_corrects_nothing(tmp_path, monkeypatch, family, peft, kv):
    """Two GRPO steps in exact mode (Triton's interpreter): the trainer's logprobs equal the sampler's at
    both (the second after an update, which with LoRA moves the adapters off zero), so the importance-sampling
    correction weighs every sequence 1. A mixture of experts routes every token as the sampler did; over the
    engine's FP8 KV cache the trainer reads its keys and values rounded as the cache holds them; a hybrid's Gated
    DeltaNet layers take every token as a decode step does, in prefill and training alike."""
    from rlcu.contracts import Numerics
    from rlcu.rollout.native import NativeRollout
    from tests.helpers import fit, match_target, toy_rows

    monkeypatch.setenv("RLCU_TRITON", "1")
    model, tok = load_model(tiny_hf_folder(tmp_path, family, vocab_size=32, hidden=32, heads=2, kv_heads=1,
                                           head_dim=16))
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=3, max_completion_length=4,
                        learning_rate=1e-2, exact_logprobs=True, micro_batch_size=4, eval_at_start=False,
                        peft_config=peft, rollout=NativeRollout({"kv_cache_dtype": kv}))
    assert module.numerics is Numerics.exact(kv)
    rows = fit(module, toy_rows(8), 2, tmp_path / "logs", batch_size=2)
    steps = [r for r in rows if "logprob_mismatch/max" in r]
    assert len(steps) == 2 and all(r["logprob_mismatch/max"] == 0.0 for r in steps), steps
    assert all(r["sampling/importance_sampling_ratio/min"] == r["sampling/importance_sampling_ratio/max"] == 1.0
               for r in steps)
    if family == "qwen3_moe":  # rows of several lengths: the packed forward's tokens meet the sampler's record
        assert all(r["moe/routing_mismatch"] == 0.0 for r in steps), steps


def test_exact_logprobs_refuses_what_it_cannot_make_exact(tmp_path):
    from rlcu.models.lora import LoraSpec

    model, tok = load_model(tiny_hf_folder(tmp_path / "a", "llama", vocab_size=32, hidden=32, heads=2, kv_heads=1,
                                           head_dim=16))
    with pytest.raises(ValueError, match="rollout: native"):
        GRPOModule(model, tokenizer=tok, rollout="reference", exact_logprobs=True)
    with pytest.raises(ValueError, match="lora_dropout > 0"):
        GRPOModule(model, tokenizer=tok, peft_config=LoraSpec(r=2, lora_dropout=0.1), exact_logprobs=True)
    small_heads, _ = load_model(tiny_hf_folder(tmp_path / "b", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                               head_dim=8))
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16 .*got 8"):
        GRPOModule(small_heads, tokenizer=tok, exact_logprobs=True)
