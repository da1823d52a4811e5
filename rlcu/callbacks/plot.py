"""At the end of a run, a PNG of reward and completion length over steps in the run folder, for users
who are offline."""
from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as L

log = logging.getLogger(__name__)
SERIES = (("reward", "mean reward"), ("completions/mean_length", "mean completion length (tokens)"))


class RewardPlot(L.Callback):
    def __init__(self, filename: str = "curves.png"):
        self.filename = filename
        self.history: dict[str, list[tuple[int, float]]] = {k: [] for k, _ in SERIES}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for key, _ in SERIES:
            if key in trainer.callback_metrics:
                self.history[key].append((trainer.global_step, float(trainer.callback_metrics[key])))

    def on_train_end(self, trainer, pl_module):
        path = Path(trainer.log_dir or trainer.default_root_dir) / self.filename  # a broadcast: every rank asks
        if not trainer.is_global_zero or not self.history["reward"]:
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("matplotlib is not installed: no %s", self.filename)
            return
        fig, axes = plt.subplots(1, len(SERIES), figsize=(10, 3.5))
        for ax, (key, label) in zip(axes, SERIES):
            steps, values = zip(*self.history[key]) if self.history[key] else ((), ())
            ax.plot(steps, values, marker="o", markersize=3)
            ax.set_xlabel("optimizer step")
            ax.set_title(label)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        log.info("wrote %s", path)
        self.path = path
