"""The arithmetic recipe through TRL's GRPOTrainer, for a side-by-side curve: same model, data (the same
held-out rows removed), rewards and their weights, group size, lengths, learning rate and seed. Writes one CSV row per
step (step, seconds since start, mean reward). trl is imported only when this runs.

    python recipes/arithmetic/trl_baseline.py --out runs/arithmetic-trl.csv [--max_steps 200] [--model PATH]"""
import argparse
import csv
import time

import yaml


def main(argv=None):
    from pathlib import Path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--max_steps", type=int, default=None, help="default: the recipe's max_steps")
    p.add_argument("--max_minutes", type=float, default=10.0)
    p.add_argument("--model", default=None, help="default: the recipe's model (the embedded SmolLM2)")
    args = p.parse_args(argv)
    recipe = yaml.safe_load((Path(__file__).parent / "config.yaml").read_text())
    m, d = recipe["model"], recipe["data"]

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcu.data.module import PromptDataModule
    from rlcu.models.loading import resolve_source
    from rlcu.rewards.base import resolve_rewards

    dm = PromptDataModule(d["dataset"], d["dataset_args"], val_size=d["val_size"], batch_size=d["batch_size"])
    dm.setup()  # the same split as rlcu's: training never sees a held-out prompt
    train = Dataset.from_list([dict(r) for r in dm.train_set])
    rewards = resolve_rewards(m["rewards"], m.get("reward_weights"))  # the recipe's rewards and weights

    def as_trl(bound):  # TRL names a reward function's metrics after its __name__
        def fn(prompts, completions, completion_ids, **kwargs):
            return bound.fn(prompts, completions, completion_ids, **kwargs)

        fn.__name__ = bound.name
        return fn

    columns = [f"rewards/{r.name}/mean" for r in rewards]
    start, rows = time.perf_counter(), []
    out = open(args.out, "w", newline="")  # a row per step as it comes, so a stopped run keeps its curve
    writer = csv.DictWriter(out, fieldnames=["step", "seconds", "reward", *columns])
    writer.writeheader()

    class Log(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rows.append({"step": state.global_step, "seconds": round(time.perf_counter() - start, 2),
                             "reward": logs["reward"], **{k: logs.get(k) for k in columns}})
                writer.writerow(rows[-1])
                out.flush()

        def on_step_end(self, a, state, control, **kw):
            if time.perf_counter() - start > args.max_minutes * 60:
                control.should_training_stop = True

    batch = d["batch_size"] * m["num_generations"]
    cfg = GRPOConfig(output_dir="/tmp/rlcu-trl-arithmetic",
                     per_device_train_batch_size=min(batch, m["micro_batch_size"]),
                     gradient_accumulation_steps=max(1, batch // m["micro_batch_size"]),
                     num_generations=m["num_generations"], max_completion_length=m["max_completion_length"],
                     learning_rate=m["learning_rate"], warmup_steps=m.get("warmup_steps", 0), loss_type=m["loss_type"],
                     temperature=m["temperature"], max_steps=args.max_steps or recipe["trainer"]["max_steps"],
                     seed=recipe["seed_everything"], bf16=torch.cuda.is_available(), logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=not torch.cuda.is_available(),
                     reward_weights=[r.weight for r in rewards])
    model = args.model or str(resolve_source(m["model"]))
    trainer = GRPOTrainer(model=model, reward_funcs=[as_trl(r) for r in rewards], args=cfg, train_dataset=train,
                          callbacks=[Log()])
    try:
        trainer.train()
    finally:
        out.close()
    return rows


if __name__ == "__main__":
    main()
