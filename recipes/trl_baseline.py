"""A recipe through TRL's GRPOTrainer, for a side-by-side curve: same model, data (the same held-out rows
removed), rewards and their weights, group size, lengths, temperature, learning rate and seed, and the recipe's
tools (TRL's `tools=`). Writes one CSV row per step (step, seconds since start, mean reward, each reward, and
with tools TRL's tools/* metrics). trl is imported only when this runs.

    python recipes/trl_baseline.py RECIPE --out runs/RECIPE-trl.csv [--max_steps 200] [--model PATH]

TRL runs tools only through a chat template it can parse calls of; for a recipe whose model has none
(`tool_format: hermes`, as SmolLM2), the tokenizer gets TRL's own Qwen2.5 template, which spells tools,
calls and results in the same Hermes convention (a <tools> block, <tool_call> JSON, <tool_response>)."""
import argparse
import csv
import time

import yaml


def main(argv=None):
    from pathlib import Path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="a folder of recipes/ (its config.yaml)")
    p.add_argument("--out", required=True)
    p.add_argument("--max_steps", type=int, default=None, help="default: the recipe's max_steps")
    p.add_argument("--max_minutes", type=float, default=10.0)
    p.add_argument("--model", default=None, help="default: the recipe's model (the embedded SmolLM2)")
    p.add_argument("--batch_size", type=int, default=None, help="prompts per step (default: the recipe's)")
    p.add_argument("--num_generations", type=int, default=None, help="default: the recipe's")
    p.add_argument("--max_completion_length", type=int, default=None, help="default: the recipe's")
    args = p.parse_args(argv)
    recipe = yaml.safe_load((Path(__file__).parent / args.recipe / "config.yaml").read_text())
    m, d = recipe["model"], recipe["data"]
    d["batch_size"] = args.batch_size or d["batch_size"]
    m["num_generations"] = args.num_generations or m["num_generations"]
    m["max_completion_length"] = args.max_completion_length or m["max_completion_length"]

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcu.data.module import PromptDataModule
    from rlcu.models.loading import resolve_source
    from rlcu.plugins import import_path
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

    tools = [import_path(t) for t in m.get("tools") or []]
    columns = [f"rewards/{r.name}/mean" for r in rewards] + (["tools/call_frequency", "tools/failure_frequency"]
                                                             if tools else [])
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
    cfg = GRPOConfig(output_dir=f"/tmp/rlcu-trl-{args.recipe}",
                     per_device_train_batch_size=min(batch, m["micro_batch_size"]),
                     gradient_accumulation_steps=max(1, batch // m["micro_batch_size"]),
                     num_generations=m["num_generations"], max_completion_length=m["max_completion_length"],
                     learning_rate=m["learning_rate"], warmup_steps=m.get("warmup_steps", 0), loss_type=m["loss_type"],
                     temperature=m["temperature"], max_steps=args.max_steps or recipe["trainer"]["max_steps"],
                     seed=recipe["seed_everything"], bf16=torch.cuda.is_available(), logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=not torch.cuda.is_available(),
                     reward_weights=[r.weight for r in rewards],
                     max_tool_calling_iterations=m.get("max_tool_calling_iterations"))
    model = args.model or str(resolve_source(m["model"]))
    trainer = GRPOTrainer(model=model, reward_funcs=[as_trl(r) for r in rewards], args=cfg, train_dataset=train,
                          callbacks=[Log()], tools=tools or None, processing_class=tokenizer_for(model, m))
    try:
        trainer.train()
    finally:
        out.close()
    return rows


def tokenizer_for(model: str, options: dict):
    """The model's tokenizer; with tools in the hermes format, carrying TRL's Qwen2.5 template (module docstring)."""
    from importlib.resources import files

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, padding_side="left")
    if options.get("tools") and options.get("tool_format") == "hermes":
        tok.chat_template = (files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return tok


if __name__ == "__main__":
    main()
