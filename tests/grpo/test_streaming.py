"""Streaming GRPO against the synchronous run: with max_staleness=0 (or 1) it is the synchronous run, step for step;
ahead of it, each token's policy version is the weights that drew it, stale groups are dropped and counted,
and a resumed run submits the pending prompts again."""
import sys
import threading

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rlcu.data.module import PromptDataModule
from rlcu.engine.llm_engine import LLMEngine
from rlcu.engine.scheduler import Scheduler
from rlcu.engine.stream import EngineStream
from rlcu.grpo.module import GRPOModule
from rlcu.grpo.update import Update
from tests.helpers import fit, match_target, toy_model, toy_rows

UNEVEN = ["t7", "t9"]  # stop words the toy model samples about one token in 16: completions of uneven lengths


def make(tiny, **kw):
    options = dict(rewards=[match_target], num_generations=4, max_completion_length=4, learning_rate=1e-2,
                   micro_batch_size=8)
    options.update(kw)
    return GRPOModule(tiny[0], tokenizer=tiny[1], **options)


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])  # a hybrid: its recurrent states' slots recycled
def test_max_staleness_0_and_1_are_the_synchronous_run_step_for_step(tmp_path, family):
    # at 1 the stream holds one step's samples (max_inflight_tasks -1: max(max_staleness, 1) steps' worth)
    runs = []
    for streaming, staleness in ((False, 0), (True, 0), (True, 1)):
        module = make(toy_model(tmp_path / "m", family), streaming=streaming,
                      **({"max_staleness": staleness} if streaming else {}), max_completion_length=6)
        metrics = fit(module, toy_rows(12, seed=2), steps=3, log_dir=tmp_path / f"{streaming}{staleness}")
        runs.append((weights(module), [m["reward"] for m in metrics if "reward" in m]))
    (sync, sync_rewards), *streams = runs
    for stream, stream_rewards in streams:
        assert len(stream_rewards) == 3 and stream_rewards == sync_rewards
        assert all(torch.equal(sync[k], stream[k]) for k in sync)


def checksum(module) -> float:
    return sum(p.double().sum().item() for p in module.policy.parameters())


class Versions(L.Callback):
    """The weights' checksum of each policy version, taken after each optimizer step."""

    def __init__(self, module):
        self.of = {0: checksum(module)}

    def on_train_batch_end(self, trainer, module, *args):
        self.of.setdefault(module.global_step, checksum(module))


def test_each_token_records_the_version_of_the_weights_that_drew_it(tmp_path, monkeypatch):
    module = make(toy_model(tmp_path / "m"), streaming=True, max_staleness=3, max_completion_length=24,
                  max_inflight_tasks=3 * 2 * 4, stop=UNEVEN)
    drawn = []  # (recorded version, weights' checksum) of every sampled token, as it is appended
    postprocess = Scheduler.postprocess

    def recording(self, seqs, tokens, logprobs):
        out = postprocess(self, seqs, tokens, logprobs)
        drawn.extend((s.seq_id, s.versions[-1], checksum(module)) for s in seqs)
        return out

    monkeypatch.setattr(Scheduler, "postprocess", recording)
    versions = Versions(module)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[versions])
    trainer.fit(module, PromptDataModule(toy_rows(40, seed=1), batch_size=2, seed=1))
    assert module.global_step == 5
    assert all(versions.of[v] == c for _, v, c in drawn)  # each token under exactly the weights of its version
    spans = {}
    for seq, v, _ in drawn:
        spans.setdefault(seq, set()).add(v)
    assert len({v for _, v, _ in drawn}) >= 3 and any(len(s) > 1 for s in spans.values())  # samples ran across updates


def test_stale_groups_are_dropped_counted_and_sampled_again(tmp_path):
    # three steps in flight, no staleness allowed: whatever decodes across an update is dropped
    rows = [{**r, "row_id": i} for i, r in enumerate(toy_rows(40, seed=1))]
    seen = []
    module = make(toy_model(tmp_path / "m"), rewards=[recorder(seen)], streaming=True, max_staleness=0,
                  max_inflight_tasks=3 * 2 * 4, max_completion_length=16, stop=UNEVEN)
    metrics = [m for m in fit(module, rows, steps=4, log_dir=tmp_path, batch_size=2) if "reward" in m]
    assert len(metrics) == 4  # every step trains
    assert sum(m["streaming/dropped_stale"] for m in metrics) > 0
    assert metrics[-1]["streaming/dropped_stale_total"] == sum(m["streaming/dropped_stale"] for m in metrics)
    assert all(m["streaming/staleness_max"] == 0 for m in metrics)  # nothing staler than allowed trains
    assert sorted(set(seen)) == sorted(seen[::4]) and all(seen.count(i) == 4 for i in seen)  # each prompt once
    lenient = make(toy_model(tmp_path / "m2"), streaming=True, max_staleness=100, max_inflight_tasks=3 * 2 * 4,
                   max_completion_length=16, stop=UNEVEN)
    kept = [m for m in fit(lenient, toy_rows(40, seed=1), steps=4, log_dir=tmp_path / "l", batch_size=2)
            if "reward" in m]
    assert sum(m["streaming/dropped_stale"] for m in kept) == 0 and max(m["streaming/staleness_max"] for m in kept) > 0
    for m in kept:
        assert {"streaming/staleness_mean", "streaming/queue_groups", "streaming/decode_batch_mean"} <= set(m)


def test_each_step_decodes_its_share_so_the_steps_stay_even(tmp_path):
    """Three steps in flight and completions of 24 tokens: each step decodes at least 24 / 3 steps. Without that
    share the batches admitted while older ones stood finished started together, and one step in three decoded
    a whole completion while the other two decoded nothing (24, 0, 0, 24, ...)."""
    module = make(toy_model(tmp_path / "m"), streaming=True, max_staleness=3, max_completion_length=24)
    rows = fit(module, toy_rows(60, seed=1), steps=8, log_dir=tmp_path, batch_size=2)
    steps = [int(r["streaming/decode_steps"]) for r in rows if "streaming/decode_steps" in r]
    assert len(steps) == 8 and all(8 <= n <= 10 for n in steps[1:]), steps  # 8 a step, +1 for the step ahead


def recorder(seen: list):
    def reward(prompts, completions, completion_ids, target, row_id, **kwargs):
        seen.extend(row_id)
        return match_target(prompts, completions, completion_ids, target)
    return reward


def test_a_resumed_run_submits_the_pending_prompts_again(tmp_path):
    rows = [{**r, "row_id": i} for i, r in enumerate(toy_rows(40, seed=4))]
    seen_a, seen_b = [], []
    options = dict(streaming=True, max_staleness=2, max_inflight_tasks=2 * 2 * 4, max_completion_length=12, stop=UNEVEN)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    first = make(toy_model(tmp_path / "m"), rewards=[recorder(seen_a)], **options)
    trainer.fit(first, PromptDataModule(rows, batch_size=2, seed=1))
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    state = torch.load(tmp_path / "a.ckpt", weights_only=False)["rlcu_stream"]
    pending = [row["row_id"] for row, _ in state["pending"]]
    assert len(pending) == 2  # one step's groups were in flight
    second = make(toy_model(tmp_path / "m"), rewards=[recorder(seen_b)], **options)
    resumed = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    resumed.fit(second, PromptDataModule(rows, batch_size=2, seed=1), ckpt_path=tmp_path / "a.ckpt")
    trained_a, trained_b = set(seen_a), set(seen_b)
    assert all(seen_b.count(i) == 4 for i in trained_b) and not trained_a & trained_b  # each group trained once
    still = {gr.row["row_id"] for gr in second.streamer.pending}
    admitted_b = trained_b | still
    assert set(pending) <= admitted_b  # what was in flight at the checkpoint went in again
    assert len(admitted_b) == len(pending) + 3 * 2  # ... beside the three batches the resumed run read


def echo(text: str) -> str:
    """Echo.

    Args:
        text: what to echo
    """
    return text


def test_streaming_refuses_what_it_cannot_run(tmp_path):
    tiny = toy_model(tmp_path / "m")
    with pytest.raises(ValueError, match="streaming=false"):
        make(tiny, streaming=True, tools=[echo], tool_format="hermes")
    with pytest.raises(ValueError, match="'streaming' capability"):
        make(tiny, streaming=True, rollout="reference")
    with pytest.raises(ValueError, match="max_inflight_tasks"):
        make(tiny, streaming=True, max_inflight_tasks=0)
    with pytest.raises(ValueError, match="set streaming=true"):
        make(tiny, decode_steps_during_training=4)
    with pytest.raises(ValueError, match="lora_dropout"):
        make(tiny, streaming=True, decode_steps_during_training=4, peft_config={"r": 4, "lora_dropout": 0.05})
    with pytest.raises(ValueError, match="decode_steps_during_training must be >= -1"):
        make(tiny, streaming=True, decode_steps_during_training=-2)


def test_a_stop_request_ends_the_stream_between_decode_steps_and_keeps_the_pending_prompts(tmp_path, monkeypatch):
    module = make(toy_model(tmp_path / "m"), streaming=True, max_staleness=0, max_completion_length=48)
    monkeypatch.setattr(module, "stop_requested", lambda: True)  # SIGTERM reached the run
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(SIGTERMException):  # Lightning's way out, which saves the checkpoint (SaveOnInterrupt)
        trainer.fit(module, PromptDataModule(toy_rows(8, seed=1), batch_size=2, seed=1))
    assert module.global_step == 0 and len(module.streamer.pending) == 2  # the step's groups, for the checkpoint
    assert module.streamer.stream is None and module.rollout.engine.stream is None  # closed, its blocks back


def test_scoring_during_generation_scores_the_same_groups_in_a_worker(tmp_path):
    """score_during_generation: each group is scored by the worker as it finishes, while the stream decodes on;
    the run is the one that scores after taking its groups, update for update."""
    runs, sizes = [], {False: set(), True: set()}

    def reward(prompts, completions, completion_ids, target, **kwargs):
        sizes[early].add(len(prompts))
        return match_target(prompts, completions, completion_ids, target)

    for early in (False, True):
        module = make(toy_model(tmp_path / "m"), rewards=[reward], streaming=True, max_staleness=2,
                      max_completion_length=16, stop=UNEVEN, score_during_generation=early)
        metrics = fit(module, toy_rows(40, seed=1), steps=4, log_dir=tmp_path / str(early), batch_size=2)
        runs.append((weights(module), [m["reward"] for m in metrics if "reward" in m]))
    (plain, plain_rewards), (early, early_rewards) = runs
    assert len(early_rewards) == 4 and early_rewards == plain_rewards
    assert all(torch.equal(plain[k], early[k]) for k in plain)
    assert sizes == {False: {8}, True: {4}}  # a step's two groups at once, or each group as it finished


class DecodedFirst:
    """EngineStream.decode_beside done in the caller's thread before it goes on: the run that the worker thread,
    decoding beside scoring and training, must equal."""

    def __init__(self, stream, steps: int):
        before, asked = stream.decode_steps, iter(range(steps + 1))
        stream.run(lambda: next(asked) >= steps)
        self.done = stream.decode_steps - before

    def wait(self) -> int:
        return self.done


@pytest.mark.parametrize("family, options", [
    ("llama", {}),
    ("qwen3_5_text", {}),  # a hybrid: its recurrent states advance in the worker
    ("qwen3_moe", dict(router_aux_loss_coef=0.01)),  # the routers' logits, kept for the loss, stay the trainer's
    ("llama", dict(peft_config={"r": 4, "lora_alpha": 8}, beta=0.04)),  # the KL reference's adapters off meanwhile
], ids=["llama", "hybrid", "moe", "lora-kl"])
def test_decoding_beside_training_is_the_run_that_decodes_those_steps_first(tmp_path, monkeypatch, family, options):
    runs = []
    for beside in (True, False):
        if not beside:
            monkeypatch.setattr(EngineStream, "decode_beside", lambda self, steps: DecodedFirst(self, steps))
        module = make(toy_model(tmp_path / "m", family), streaming=True, max_staleness=2, max_completion_length=16,
                      stop=UNEVEN, decode_steps_during_training=3, **options)
        metrics = [m for m in fit(module, toy_rows(40, seed=1), steps=5, log_dir=tmp_path / str(beside),
                                  batch_size=2) if "reward" in m]
        runs.append((weights(module), metrics))
    (threaded, threaded_metrics), (first, first_metrics) = runs
    assert len(threaded_metrics) == 5 and all(torch.equal(threaded[k], first[k]) for k in first)
    for a, b in zip(threaded_metrics, first_metrics, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(("timing/", "tokens_per", "memory/"))} == {
            k: v for k, v in b.items() if not k.startswith(("timing/", "tokens_per", "memory/"))}
    assert [m["streaming/decode_steps_beside"] for m in threaded_metrics[1:]] == [4.0] * 4  # +1: the step ahead


@pytest.mark.parametrize("beside", [4, -1], ids=["4-steps", "until-trained"])
def test_decoding_beside_training_ends_before_each_optimizer_step(tmp_path, monkeypatch, beside):
    """Every decode step starts and ends on one set of weights, none while the optimizer steps, and its tokens record
    the version of those weights; some of them run in the worker beside training (4 a step, or with -1 as many as
    the training leaves time for)."""
    module = make(toy_model(tmp_path / "m"), streaming=True, max_staleness=3, max_completion_length=24,
                  max_inflight_tasks=3 * 2 * 4, stop=UNEVEN, decode_steps_during_training=beside)
    stepping, steps, drawn = [False], [], []
    wait, optimizer_step, engine_step, postprocess = (GRPOModule.before_weights_change, Update._optimizer_step,
                                                      LLMEngine.step, Scheduler.postprocess)

    def then_step(self):
        wait(self)
        stepping[0] = True

    def step_and_clear(self):
        try:
            return optimizer_step(self)
        finally:
            stepping[0] = False

    def watched(self):
        before, during = checksum(module), stepping[0]
        engine_step(self)
        steps.append((threading.current_thread().name, during or stepping[0], before == checksum(module)))

    def recording(self, seqs, tokens, logprobs):
        out = postprocess(self, seqs, tokens, logprobs)
        drawn.extend((s.versions[-1], checksum(module)) for s in seqs)
        return out

    for cls, name, fn in ((GRPOModule, "before_weights_change", then_step), (Update, "_optimizer_step", step_and_clear),
                          (LLMEngine, "step", watched), (Scheduler, "postprocess", recording)):
        monkeypatch.setattr(cls, name, fn)
    versions, interval = Versions(module), sys.getswitchinterval()
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[versions])
    trainer.fit(module, PromptDataModule(toy_rows(40, seed=1), batch_size=2, seed=1))
    assert module.global_step == 5 and sys.getswitchinterval() == interval  # shortened only while decoding beside
    assert not any(overlapped for _, overlapped, _ in steps) and all(same for _, _, same in steps)
    assert sum(name == "rlcu-decode-beside" for name, _, _ in steps) >= (4 * 4 if beside > 0 else 1)
    assert all(versions.of[v] == c for v, c in drawn)
