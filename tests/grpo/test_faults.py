"""Numerical faults: NaN from a reward or in the logits skips that update (no NaN reaches the weights),
is counted in the logs, and too many in a row stop the run with a clear error."""
import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from rlcu.data.module import PromptDataModule
from rlcu.data.prompts import collate_rows
from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from tests.helpers import CHAT_TEMPLATE, match_target, tiny_hf_folder, toy_rows


class Snapshots(L.Callback):
    def __init__(self):
        self.weights, self.metrics = [], []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.weights.append([p.detach().clone() for p in pl_module.policy.parameters()])
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def train(tmp_path, rewards, steps=4, hook=None):
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    module = GRPOModule(model, tokenizer=tok, rewards=rewards, num_generations=4, max_completion_length=4,
                        learning_rate=1e-2, rollout="reference")
    if hook:
        module.policy.model.norm.register_forward_hook(hook(module))
    snaps = Snapshots()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[snaps])
    trainer.fit(module, DataLoader(toy_rows(4 * steps), batch_size=4, collate_fn=collate_rows))
    return snaps


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def nan_reward_on_call(call):
    calls = {"n": 0}

    def reward(prompts, completions, completion_ids, **kw):
        calls["n"] += 1
        values = match_target(prompts, completions, completion_ids, **kw)
        return [float("nan")] + values[1:] if calls["n"] == call else values
    return reward


def test_a_nan_reward_skips_that_update(tmp_path):
    snaps = train(tmp_path, [nan_reward_on_call(2)])  # the second batch
    assert len(snaps.weights) == 5  # a skipped update is no optimizer step: max_steps=4 takes one batch more
    assert not same(snaps.weights[0], snaps.weights[2]), "the steps around the fault still train"
    assert same(snaps.weights[0], snaps.weights[1]), "the faulty batch changed the weights"
    assert snaps.metrics[1]["faults/skipped_updates"] == 1 and snaps.metrics[3]["faults/skipped_updates"] == 1


def test_nan_in_the_logits_never_reaches_the_weights(tmp_path):
    done = []

    def poison(module):
        def hook(mod, args, out):
            if torch.is_grad_enabled() and module.global_step == 1 and not done:  # the second batch's training
                done.append(True)
                normed = out[0].clone()
                normed[0] = float("nan")
                return (normed, *out[1:])
            return out
        return hook

    snaps = train(tmp_path, [match_target], hook=poison)
    assert same(snaps.weights[0], snaps.weights[1])
    assert all(torch.isfinite(p).all() for p in snaps.weights[-1])
    assert snaps.metrics[1]["faults/skipped_updates"] == 1


def test_repeated_faults_stop_the_run(tmp_path):
    def always_nan(completions, **kw):
        return [float("nan")] * len(completions)

    with pytest.raises(RuntimeError, match="3 updates in a row were skipped for numerical faults"):
        train(tmp_path, [always_nan], steps=6)


def test_long_prompts_are_an_error_or_lose_their_start(tmp_path, caplog):
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    long_prompt = " ".join(f"t{i % 20}" for i in range(30))
    strict = GRPOModule(model, tokenizer=tok, rewards=[match_target], max_prompt_length=8, max_completion_length=4)
    with pytest.raises(ValueError, match="prompt 0 has 30 tokens, more than max_prompt_length=8.*truncate_left"):
        strict.encode(long_prompt, 0)
    lenient = GRPOModule(model, tokenizer=tok, rewards=[match_target], max_prompt_length=8, max_completion_length=4,
                         long_prompts="truncate_left")
    assert lenient.encode(long_prompt, 0) == tok(long_prompt, add_special_tokens=False).input_ids[-8:]
    rows = [{"prompt": long_prompt, "target": 9}] * 4
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level("WARNING"):
        trainer.fit(lenient, PromptDataModule(rows, batch_size=4))
    assert "4 of 4 training prompts are longer than max_prompt_length=8" in caplog.text
    for bad, says in ((long_prompt, "prompt 2 has 30 tokens"), ("", "prompt 2 encodes to no tokens")):
        data = PromptDataModule([{"prompt": "t1 t2", "target": 9}] * 2 + [{"prompt": bad, "target": 9}], batch_size=3)
        with pytest.raises(ValueError, match=says) as raised:
            L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False).fit(strict, data)
        assert any(entry.name == "on_fit_start" for entry in raised.traceback)  # at set-up, before any step
    with pytest.raises(ValueError, match="long_prompts must be one of"):
        GRPOModule(model, tokenizer=tok, rewards=[match_target], long_prompts="cut")


class EdgeRollout:
    """Half the samples are only the end-of-sequence token (empty text), half never stop (cut at max_tokens)."""

    def setup(self, policy, tokenizer):
        from rlcu.contracts import eos_token_ids

        self.eos = eos_token_ids(policy.config, tokenizer)[0]

    def generate(self, prompt_ids, sampling):
        from rlcu.rollout.base import RolloutBatch

        done = [[self.eos] if i % 2 == 0 else [5] * sampling.max_tokens for i in range(len(prompt_ids))]
        return RolloutBatch([list(p) for p in prompt_ids], done, [[-1.0] * len(c) for c in done],
                            ["stop" if i % 2 == 0 else "length" for i in range(len(prompt_ids))])

    def release(self):
        pass

    def on_weights_updated(self):
        pass


def test_empty_completions_and_ones_that_never_stop(tmp_path):
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    seen = []

    def text_length(completions, **kw):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    module = GRPOModule(model, tokenizer=tok, rewards=[text_length], num_generations=4, max_completion_length=6,
                        rollout=EdgeRollout(), learning_rate=1e-2, mask_truncated_completions=True)
    snaps = Snapshots()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[snaps])
    trainer.fit(module, DataLoader(toy_rows(4), batch_size=4, collate_fn=collate_rows))
    assert "" in seen  # the EOS-only completions reached the reward as empty text
    m = snaps.metrics[0]
    assert m["completions/min_length"] == 1 and m["completions/max_length"] == 6
    assert m["completions/clipped_ratio"] == 0.5
    assert all(torch.isfinite(p).all() for p in snaps.weights[0])


def test_fault_counters_are_saved_in_checkpoints(tmp_path):
    """A resumed run goes on counting skipped updates instead of starting again from zero."""
    model, tok = load_model(tiny_hf_folder(tmp_path, chat_template=CHAT_TEMPLATE))
    module = GRPOModule(model, tokenizer=tok, num_generations=2, max_completion_length=4)
    module.counters.faults, module.counters.consecutive_faults = 5, 2
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    resumed = GRPOModule(model, tokenizer=tok, num_generations=2, max_completion_length=4)
    resumed.on_load_checkpoint(checkpoint)
    assert (resumed.counters.faults, resumed.counters.consecutive_faults) == (5, 2)


def test_rewards_in_processes_train_and_a_spinning_one_is_killed(tmp_path):
    """reward_isolation=process: each reward call runs in a forked process (a closure needs no pickling), and a
    call past reward_timeout is killed instead of spinning on beside the run."""
    import multiprocessing
    import time

    from tests.helpers import fit, toy_model

    calls = []

    def spins_on_odd_digits(prompts, completions, completion_ids, target, **kwargs):
        calls.append(len(prompts))  # in the child: the parent's list never grows
        if any(p.endswith(("1", "3", "5", "7")) for p in prompts):  # the batch call, then those samples alone
            while True:
                pass
        return match_target(prompts, completions, completion_ids, target)

    model, tok = toy_model(tmp_path / "m")
    module = GRPOModule(model, tokenizer=tok, rewards=[spins_on_odd_digits], num_generations=4,
                        max_completion_length=4, micro_batch_size=8, reward_isolation="process", reward_timeout=1.0,
                        on_reward_error="none")
    start = time.perf_counter()
    metrics = [m for m in fit(module, toy_rows(8, seed=5), steps=2, log_dir=tmp_path) if "reward" in m]
    assert len(metrics) == 2 and calls == [] and not multiprocessing.active_children()
    assert 0 < sum(m["rewards/spins_on_odd_digits/mean"] >= 0 for m in metrics)  # the even samples were scored
    assert time.perf_counter() - start < 30
