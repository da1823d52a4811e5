"""A recipe run's learning curves from its metrics.csv (Lightning's CSVLogger), beside TRL's if given
(the CSV of a recipe's trl_baseline.py): held-out greedy accuracy by step, and the mean of one reward by
step and by minute of training (TRL's held-out accuracy too where its CSV has it).

    python recipes/curves.py runs/arithmetic/version_0/metrics.csv --trl runs/arithmetic-trl.csv \\
        --reward rewards/math_answer/mean --out recipes/arithmetic/curves.png"""
from __future__ import annotations

import argparse
import csv


def read(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def series(rows: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(float(r[x]), float(r[y])) for r in rows if r.get(x) not in (None, "") and r.get(y) not in (None, "")]
    return [p[0] for p in points], [p[1] for p in points]


def smooth(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="rlcu's metrics.csv")
    p.add_argument("--trl", help="the recipe's trl_baseline.py CSV")
    p.add_argument("--reward", default="reward", help="the reward column to compare (default: the weighted total)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rlcu = read(args.metrics)
    trl = read(args.trl) if args.trl else None
    steps, acc = series(rlcu, "step", "eval/accuracy")
    # a run without held-out evaluation: no accuracy panel
    fig, axes = plt.subplots(1, 3 if acc else 2, figsize=(15 if acc else 10, 4))
    if acc:
        axes[0].plot(steps, acc, marker="o", label="rlcu")
        trl_steps, trl_acc = series(trl or [], "step", "eval/accuracy")  # trl_baseline.py's rlcu-run evaluation
        if trl_acc:
            axes[0].plot(trl_steps, trl_acc, marker="s", label="TRL")
        axes[0].set(xlabel="optimizer step", ylabel="held-out greedy accuracy", title="eval/accuracy")
    axes = [None, *axes] if not acc else list(axes)
    runs = [("rlcu", rlcu, "timing/elapsed")]
    if trl:
        runs.append(("TRL", trl, "seconds"))
    for name, rows, clock in runs:
        step, reward = series(rows, "step", args.reward)
        axes[1].plot(step, smooth(reward), label=f"{name} (mean of 10 steps)")
        seconds, reward = series(rows, clock, args.reward)
        axes[2].plot([s / 60 for s in seconds], smooth(reward), label=name)
    axes[1].set(xlabel="optimizer step", ylabel=args.reward, title="reward by step")
    axes[2].set(xlabel="minutes of training", ylabel=args.reward, title="reward by wall time")
    for ax in axes[0 if acc else 1:]:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
