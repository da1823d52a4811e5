"""A recipe through TRL's GRPOTrainer, for a side-by-side curve: same model, data (the same held-out rows
removed), rewards and their weights, group size, lengths, temperature, learning rate and seed, and the recipe's
tools (TRL's `tools=`). Writes one CSV row per step (step, seconds since start, mean reward, each reward, and
with tools TRL's tools/* metrics). trl is imported only when this runs.

Held-out accuracy: where the recipe holds rows out (`data.val_size`), rlcu's own evaluation (the same rows,
prompts, greedy decoding and accuracy reward as the rlcu run's `eval/accuracy`) runs on TRL's current weights
before the first step, every `--eval_every` steps and on the weights `--max_minutes` stops at, each a CSV row
with `eval/accuracy`; its time is left out of `seconds`, which counts TRL's training alone.

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
    p.add_argument("--model", default=None, help="a folder, a hub id or an embedded name (default: the recipe's)")
    p.add_argument("--batch_size", type=int, default=None, help="prompts per step (default: the recipe's)")
    p.add_argument("--num_generations", type=int, default=None, help="default: the recipe's")
    p.add_argument("--max_completion_length", type=int, default=None, help="default: the recipe's")
    p.add_argument("--eval_every", type=int, default=None,
                   help="steps between held-out evaluations (default: the recipe's val_check_interval; 0: none)")
    args = p.parse_args(argv)
    recipe = yaml.safe_load((Path(__file__).parent / args.recipe / "config.yaml").read_text())
    from rlcu.grpo.options import DEFAULTS

    m, d = {**DEFAULTS, **recipe["model"]}, recipe["data"]  # what the recipe leaves out, as rlcu runs it
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

    dm = PromptDataModule(**d)  # the recipe's data section, as rlcu run builds it
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
    start, rows, evaluating = time.perf_counter(), [], [0.0]  # seconds spent in held-out evaluation
    out = open(args.out, "w", newline="")  # a row per step as it comes, so a stopped run keeps its curve
    writer = csv.DictWriter(out, fieldnames=["step", "seconds", "reward", *columns, "eval/accuracy", "eval/reward"])
    writer.writeheader()
    every = recipe["trainer"].get("val_check_interval", 0) if args.eval_every is None else args.eval_every
    every = every if dm.val_set else 0

    def write(step: int, **values):
        seconds = time.perf_counter() - start - evaluating[0]
        rows.append({"step": step, "seconds": round(seconds, 2), **values})
        writer.writerow(rows[-1])
        out.flush()

    model = str(resolve_source(args.model or m["model"]))  # a path, a hub id or an embedded name

    def held_out(step: int, weights):
        began = time.perf_counter()
        metrics = held_out_metrics(weights, model, m, dm.val_set, dm.val_batch_size)
        evaluating[0] += time.perf_counter() - began
        write(step, **{k: metrics[k] for k in ("eval/accuracy", "eval/reward")})
        print(f"step {step}: held-out accuracy {metrics['eval/accuracy']:.3f}", flush=True)

    class Log(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            if every:
                held_out(0, model)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                write(state.global_step, reward=logs["reward"], **{k: logs.get(k) for k in columns})

        def on_step_end(self, a, state, control, model=None, **kw):
            evaluated = bool(every) and state.global_step % every == 0
            if evaluated:
                held_out(state.global_step, model)
            if time.perf_counter() - start - evaluating[0] > args.max_minutes * 60:
                control.should_training_stop = True
                if every and not evaluated:  # the curve ends on the weights the run stops with
                    held_out(state.global_step, model)

    batch = d["batch_size"] * m["num_generations"]
    cfg = GRPOConfig(output_dir=f"/tmp/rlcu-trl-{args.recipe}",
                     per_device_train_batch_size=min(batch, m["micro_batch_size"]),
                     gradient_accumulation_steps=max(1, batch // m["micro_batch_size"]),
                     num_generations=m["num_generations"], max_completion_length=m["max_completion_length"],
                     learning_rate=m["learning_rate"], warmup_steps=m.get("warmup_steps", 0), loss_type=m["loss_type"],
                     lr_scheduler_type=m.get("lr_scheduler", "constant"),
                     temperature=m["temperature"], max_steps=args.max_steps or recipe["trainer"]["max_steps"],
                     seed=recipe["seed_everything"], bf16=torch.cuda.is_available(), logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=not torch.cuda.is_available(),
                     reward_weights=[r.weight for r in rewards],
                     max_tool_calling_iterations=m.get("max_tool_calling_iterations"),
                     **{k: m[k] for k in SAME_NAMES if k in recipe["model"]})
    trainer = GRPOTrainer(model=model, reward_funcs=[as_trl(r) for r in rewards], args=cfg, train_dataset=train,
                          callbacks=[Log()], tools=tools or None, processing_class=tokenizer_for(model, m))
    try:
        trainer.train()
    finally:
        out.close()
    return rows


# GRPOModule options spelled and meant as GRPOConfig's: a recipe that sets one sets it on TRL's side too
SAME_NAMES = ("epsilon", "epsilon_high", "beta", "top_p", "top_k", "min_p",
              "mask_truncated_completions", "top_entropy_quantile", "num_iterations")


def held_out_metrics(weights, model_path: str, options: dict, rows: list[dict], batch_size: int) -> dict:
    """rlcu's held-out greedy metrics (`eval/accuracy`, `eval/reward`, ...) of TRL's model as it is now: its
    weights saved to a temporary folder with the recipe model's own tokenizer (not the tool template TRL may
    have been given), loaded by a GRPOModule with the recipe's options, and evaluated as `rlcu eval` does."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from rlcu.grpo.evaluation import evaluate_all
    from rlcu.grpo.module import GRPOModule

    folder = tempfile.mkdtemp(prefix="rlcu-trl-eval-")
    try:
        weights.save_pretrained(folder)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)
        module = GRPOModule(**{**options, "model": folder, "eval_num_samples": 0, "num_generations_eval": None})
        device = next(weights.parameters()).device
        module.to(device).eval()
        module.setup("validate")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):  # the recipe's bf16-mixed
            return evaluate_all(module, rows, batch_size)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
