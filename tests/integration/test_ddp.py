"""Two DDP processes (gloo, CPU) make the same update as one process on the same global batch.

The rollouts come from a deterministic backend, so both runs train on identical completions and the
test isolates what DDP changes: sharding prompts with their groups kept whole, advantages per group,
the loss normaliser over all ranks (completion lengths differ between ranks on purpose), gradient
averaging and metric reduction. Tolerance: 1e-6 (float32, all-reduce order)."""
import pytest
import torch

from rlcu.data.module import PromptDataModule
from rlcu.grpo.module import GRPOModule
from tests.helpers import FixedRollout, G, tiny_hf_folder, token_value, toy_rows

STEPS = 2








def flat_for_some_prompts(prompts, completions, completion_ids, **kwargs):
    """Zero variance (one value for the whole group) for prompts with an odd digit, token_value for the rest."""
    return [0.5 if p.endswith(("1", "3", "5", "7")) else v
            for p, v in zip(prompts, token_value(prompts, completions, completion_ids))]


def train(folder, devices, batch_size, loss_type, reward=token_value, filter_zero_std_groups=False):
    import lightning.pytorch as L

    torch.manual_seed(0)
    module = GRPOModule(str(folder), rewards=[reward], rollout=FixedRollout(), num_generations=G,
                        max_completion_length=4, learning_rate=1e-2, loss_type=loss_type, micro_batch_size=4,
                        filter_zero_std_groups=filter_zero_std_groups)
    data = PromptDataModule(toy_rows(16, seed=3), batch_size=batch_size, seed=1)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto",
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, data)
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_ddp_processes_update_like_one(tmp_path, loss_type):
    folder = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8)
    one = train(folder, 1, 4, loss_type)
    two = train(folder, 2, 2, loss_type)
    from rlcu.models import load_model

    initial = load_model(folder)[0].state_dict()
    moved = max((one[k] - initial[k]).abs().max().item() for k in one)
    assert moved > 1e-3, "the update is too small for the comparison to mean anything"
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-6, f"DDP update differs from one process by {worst:.2e}"


@pytest.mark.slow
def test_filtering_zero_std_groups_under_ddp_updates_like_one_process(tmp_path):
    """DAPO's dynamic sampling: groups whose rewards are all equal teach nothing and are dropped. Under DDP
    the ranks keep the rows (masked) so that they run the same backward passes; with dapo's global token
    normaliser the update equals one process dropping them."""
    folder = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8)
    one = train(folder, 1, 4, "dapo", flat_for_some_prompts, True)
    two = train(folder, 2, 2, "dapo", flat_for_some_prompts, True)
    unfiltered = train(folder, 1, 4, "dapo", flat_for_some_prompts, False)
    # float32 reduction order, grown by Adam's division by small gradients' RMS (seen: 1.2e-6); the filter's
    # own effect on the weights is 1e-2
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    assert max((one[k] - unfiltered[k]).abs().max().item() for k in one) > 1e-3, "the filter changed nothing"


def test_filtering_under_ddp_needs_dapo(tmp_path):
    folder = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8)
    module = GRPOModule(str(folder), rewards=[token_value], rollout=FixedRollout(), num_generations=G,
                        max_completion_length=4, loss_type="grpo", filter_zero_std_groups=True)

    class TwoRanks:
        world_size, strategy = 2, None

    module._trainer = TwoRanks()
    with pytest.raises(ValueError, match="needs loss_type='dapo'"):
        module.setup("fit")


@pytest.mark.slow
def test_a_recipe_runs_under_ddp_from_the_command_line(tmp_path):
    """`rlcu run RECIPE --trainer.devices=2 --trainer.strategy=ddp` with the recipe's callbacks (checkpoints,
    completion table, curves, time limit) and held-out evaluation: Lightning re-launches rank 1 from
    sys.argv, and every collective (some hide in trainer.log_dir) must happen on both ranks, or the run hangs."""
    import csv
    import subprocess
    import sys

    from tests.helpers import CHAT_TEMPLATE

    folder = tiny_hf_folder(tmp_path / "tiny", "llama", chat_template=CHAT_TEMPLATE)
    cmd = [sys.executable, "-m", "rlcu.cli", "run", "arithmetic", f"--model.model={folder}",
           "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.precision=32-true",
           "--trainer.max_steps=3",
           "--trainer.val_check_interval=2", "--data.val_size=16", "--data.batch_size=2", "--model.eval_at_start=false"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "arithmetic"
    rows = list(csv.DictReader(open(run / "version_0" / "metrics.csv")))
    assert {int(r["step"]) for r in rows if r.get("reward")} == {1, 2, 3}  # optimizer steps taken, as TRL counts
    assert any(r.get("eval/accuracy") for r in rows)
    assert (run / "ckpt" / "last.ckpt").exists() and (run / "version_0" / "completions.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("beside", [0, 4])  # and with decode steps beside each rank's training
def test_streaming_under_ddp_steps_in_lockstep(tmp_path, beside):
    """Each rank streams its own prompts, drops and samples again what is too stale on its own, and still steps
    with the other: four optimizer steps each, without a rank waiting on a collective the other never joins."""
    import lightning.pytorch as L

    from tests.helpers import match_target, toy_model

    model, tokenizer = toy_model(tmp_path / "m")
    module = GRPOModule(model, tokenizer=tokenizer, rewards=[match_target], num_generations=4, learning_rate=1e-2,
                        max_completion_length=16, stop=["t7", "t9"], micro_batch_size=8, loss_type="dapo",
                        streaming=True, max_staleness=1, max_inflight_tasks=3 * 2 * 4,
                        decode_steps_during_training=beside)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(toy_rows(64, seed=2), batch_size=2, seed=1))
    # (ddp_spawn hands back rank 0's weights and metrics, not its loop's counters)
    assert trainer.callback_metrics["streaming/staleness_max"] <= 1
    assert ("streaming/decode_steps_beside" in trainer.callback_metrics) == bool(beside)
    moved = max((p - q).abs().max().item() for p, q in zip(module.policy.parameters(), toy_model(tmp_path / "m")[0]
                                                          .parameters()))
    assert moved > 1e-3
