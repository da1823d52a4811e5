"""Held-out evaluation: the metric maths by hand, the module's greedy accuracy against a direct
computation, the held-out split, and `rlcu eval` reproducing a run's final accuracy from its checkpoint."""
import csv

import pytest
import torch

from rlcu import cli
from rlcu.data.module import PromptDataModule
from rlcu.grpo.evaluation import evaluate
from rlcu.grpo.metrics import eval_metrics
from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder, toy_rows


def test_eval_metrics_by_hand():
    greedy = torch.tensor([True, False, True, False])
    sampled = torch.tensor([[False, False, True], [False, False, False], [True, True, True], [False, True, False]])
    m = eval_metrics(greedy, torch.tensor([1.0, 0.0, 0.5, float("nan")]), torch.tensor([3, 5, 2, 6]), sampled)
    assert m["eval/accuracy"] == 0.5
    assert m["eval/reward"] == pytest.approx(0.5)  # the unscorable row is left out, not counted as 0
    assert m["eval/mean_length"] == 4.0
    assert m["eval/pass@3"] == 0.75
    assert m["eval/mean@3"] == pytest.approx(5 / 12)


def exact_target(prompts, completions, completion_ids, target, **kwargs):
    """1 when the first completion token is the row's target token."""
    return [float(bool(ids) and ids[0] == t) for ids, t in zip(completion_ids, target)]




def test_module_accuracy_is_the_greedy_accuracy(tmp_path):
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    rows = toy_rows(24, seed=5)
    module = GRPOModule(model, tokenizer=tok, rewards=[exact_target], num_generations=2, max_completion_length=3,
                        eval_num_samples=3)
    module.setup("validate")
    metrics = evaluate(module, rows)
    ids = [tok(r["prompt"], add_special_tokens=False).input_ids for r in rows]
    greedy = module.rollout.generate(ids, SamplingParams(max_tokens=3, temperature=0,
                                                         stop_token_ids=module.stop_token_ids))
    expected = sum(c[0] == r["target"] for c, r in zip(greedy.completion_ids, rows) if c) / len(rows)
    assert metrics["eval/accuracy"] == pytest.approx(expected)
    assert 0 <= metrics["eval/mean@3"] <= metrics["eval/pass@3"] <= 1


def test_trls_num_generations_eval_sets_the_samples_per_held_out_prompt(tmp_path):
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    module = GRPOModule(model, tokenizer=tok, rewards=[exact_target], num_generations=2, max_completion_length=3,
                        num_generations_eval=3)
    module.setup("validate")
    assert {"eval/pass@3", "eval/mean@3"} <= set(evaluate(module, toy_rows(4, seed=1)))
    with pytest.raises(ValueError, match="are one option"):
        GRPOModule(model, tokenizer=tok, rewards=[exact_target], num_generations_eval=3, eval_num_samples=2)


def test_held_out_split_never_reaches_training():
    rows = [{"prompt": f"p{i % 30}", "answer": str(i)} for i in range(60)]  # every prompt twice
    dm = PromptDataModule(rows, val_size=10)
    dm.setup()
    held = {r["prompt"] for r in dm.val_set}
    assert len(dm.val_set) == 10 and not held & {r["prompt"] for r in dm.train_set}
    assert len(dm.train_set) == 60 - 10 - 10  # the earlier copies of the held-out prompts are dropped too
    with pytest.raises(ValueError, match="val_size"):
        PromptDataModule(rows, val_size=60).setup()
    games = [{"prompt": "guess", "target": i % 7, "game": i} for i in range(40)]  # one prompt, hidden targets
    with pytest.raises(ValueError, match="set hold_out_by: row"):
        PromptDataModule(games, val_size=5).setup()
    dm = PromptDataModule(games, val_size=5, hold_out_by="row")
    dm.setup()
    assert len(dm.train_set) == 35 and not {r["game"] for r in dm.val_set} & {r["game"] for r in dm.train_set}


def test_held_out_rows_are_evaluated_in_batches_of_val_batch_size():
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(40)]
    dm = PromptDataModule(rows, val_size=10, batch_size=4)
    assert [len(b) for b in dm.val_dataloader()] == [10]  # by default all at once (up to 256), not 4 at a time
    dm = PromptDataModule(rows, val_size=10, batch_size=4, val_batch_size=3)
    assert [len(b) for b in dm.val_dataloader()] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="val_batch_size must be >= 1"):
        PromptDataModule(rows, val_size=10, val_batch_size=0).setup()


def test_held_out_from_another_split(tmp_path, monkeypatch):
    """val_split: the other split's first val_size rows; a training row asking one of them is still dropped."""
    import datasets

    from rlcu.data import sources

    splits = {"train": [{"prompt": f"p{i}"} for i in range(20)], "test": [{"prompt": f"p{i}"} for i in (3, 30, 31)]}
    monkeypatch.setattr(sources, "load_rows", lambda path, split, name=None: datasets.Dataset.from_list(splits[split]))
    dm = PromptDataModule("some/hub-dataset", {"split": "train"}, val_split="test", val_size=2)
    dm.setup()
    assert [r["prompt"] for r in dm.val_set] == ["p3", "p30"]
    assert len(dm.train_set) == 19 and "p3" not in {r["prompt"] for r in dm.train_set}
    for bad, match in [(dict(dataset="arithmetic"), "generated or given rows"),
                       (dict(dataset=splits["train"]), "generated or given rows"),
                       (dict(dataset="some/hub-dataset", val_size=0), "needs val_size >= 1")]:
        with pytest.raises(ValueError, match=match):
            PromptDataModule(**{"val_size": 2, **bad}, val_split="test").setup()


def test_rlcu_eval_reproduces_the_final_metrics_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    import json

    monkeypatch.chdir(tmp_path)
    model = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           chat_template=CHAT_TEMPLATE)
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in toy_rows(64, seed=1)))
    common = [f"--model.model={model}", "--model.max_completion_length=4", "--model.max_prompt_length=64",
              "--model.rewards=[tests.helpers.first_token_value]", "--model.eval_num_samples=2",
              f"--data.dataset={data}",
              "--data.dataset_args=null", "--data.val_size=8", "--data.batch_size=4",
              "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
              "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]"]
    cli.main(["run", "quickstart", *common, "--model.learning_rate=5e-2", "--model.num_generations=8",
              "--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.check_val_every_n_epoch=null",
              "--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.save_last=true"])
    logged = [r for r in csv.DictReader(open(next(tmp_path.glob("lightning_logs/version_0/metrics.csv"))))
              if r.get("eval/reward")]
    assert len(logged) == 3, logged  # before training (step 0), after steps 3 and 6
    start, final = float(logged[0]["eval/reward"]), float(logged[-1]["eval/reward"])
    assert start != final, "training did not change the greedy completions: the check below would prove nothing"

    def evaluated(*extra) -> float:
        capsys.readouterr()
        cli.main(["eval", "quickstart", *common, *extra])
        line = next(x for x in capsys.readouterr().out.splitlines() if "eval/reward" in x)
        return float(line.replace("│", " ").split()[-1])

    assert evaluated(f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}") == pytest.approx(final, abs=1e-6)
    assert evaluated() == pytest.approx(start, abs=1e-6)  # no checkpoint: the model as it started


@pytest.mark.parametrize("precision, autocast", [("bf16-mixed", torch.bfloat16), ("32-true", None)])
def test_the_evaluation_before_training_runs_in_the_trainers_precision(tmp_path, monkeypatch, precision, autocast):
    """The curve's first point is computed as the later ones (validation_step, under the precision's autocast)."""
    import lightning.pytorch as pl

    from rlcu.grpo import evaluation

    seen = []

    def record(module, rows, batch_size):
        on = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if on else None)
        return {"eval/accuracy": 0.0}

    monkeypatch.setattr(evaluation, "evaluate_all", record)
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    module = GRPOModule(model, tokenizer=tok, rewards=[exact_target], num_generations=2, max_completion_length=2)
    dm = PromptDataModule(dataset=toy_rows(8, seed=2), batch_size=2, val_size=2)
    trainer = pl.Trainer(accelerator="cpu", precision=precision, max_steps=1, val_check_interval=1,
                         check_val_every_n_epoch=None, limit_val_batches=0.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    monkeypatch.setattr(module, "_evaluates_later", lambda: True)
    trainer.fit(module, datamodule=dm)
    assert seen[:1] == [autocast]
