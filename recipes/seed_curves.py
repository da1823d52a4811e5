"""Held-out accuracy per sample trained, over seeds, for runs of one recipe in two or more modes (streaming against
synchronous, say): each mode's mean and its seeds' range at every evaluation, a plot, a Markdown table, and whether
each mode's mean stays within the first mode's range (issue #44's "within the seeds' spread").

    python recipes/seed_curves.py --run synchronous s0.csv s1.csv s2.csv --run streaming t0.csv t1.csv t2.csv \\
        --samples_per_step 128 --out recipes/arithmetic/streaming.png

Each CSV is a run's metrics.csv (Lightning's CSVLogger); samples trained = optimizer steps x samples_per_step
(data.batch_size x num_generations: both modes train that many a step)."""
from __future__ import annotations

import argparse
import csv
from typing import NamedTuple


class Point(NamedTuple):
    samples: int
    mean: float
    low: float
    high: float


def accuracy_by_step(path: str, column: str = "eval/accuracy") -> dict[int, float]:
    with open(path) as f:
        return {int(float(r["step"])): float(r[column]) for r in csv.DictReader(f) if r.get(column) not in (None, "")}


def points(paths: list[str], samples_per_step: int) -> list[Point]:
    """The mean and range over seeds at each step every run evaluated."""
    runs = [accuracy_by_step(p) for p in paths]
    empty = [p for p, run in zip(paths, runs) if not run]
    if empty:
        raise SystemExit(f"seed_curves: {empty[0]} has no eval/accuracy; run the recipe with val_check_interval set")
    steps = sorted(set.intersection(*(set(run) for run in runs)))
    return [Point(s * samples_per_step, sum(r[s] for r in runs) / len(runs), min(r[s] for r in runs),
                  max(r[s] for r in runs)) for s in steps]


def within(reference: list[Point], at: Point) -> bool | None:
    """Whether `at`'s mean lies within the reference's range at the same samples, the range linear between the
    reference's evaluations (a streaming run evaluates at other steps: its first steps only fill the stream); None
    outside the reference's evaluations."""
    for a, b in zip(reference, reference[1:] or reference):
        if a.samples <= at.samples <= b.samples:
            f = 0.0 if b.samples == a.samples else (at.samples - a.samples) / (b.samples - a.samples)
            return a.low + f * (b.low - a.low) <= at.mean <= a.high + f * (b.high - a.high)
    return None


def table(modes: dict[str, list[Point]]) -> str:
    """Markdown: one row for each number of samples some mode evaluated at, each mode's mean [low, high] there; and
    whether the other modes' means lie within the first mode's range; then each mode's count of those."""
    names = list(modes)
    reference = modes[names[0]]
    rows = [f"| samples trained | {' | '.join(names)} | within {names[0]}'s range |",
            "| --- " * (len(names) + 2) + "|"]
    counts = {n: [0, 0] for n in names[1:]}
    for s in sorted({p.samples for pts in modes.values() for p in pts}):
        at = {n: next((p for p in modes[n] if p.samples == s), None) for n in names}
        verdicts = []
        for n in names[1:]:
            inside = None if at[n] is None else within(reference, at[n])
            if inside is not None:
                counts[n][0] += inside
                counts[n][1] += 1
                verdicts.append(f"{n}: {'yes' if inside else 'no'}")
        cells = " | ".join("" if at[n] is None else f"{at[n].mean:.1%} [{at[n].low:.1%}, {at[n].high:.1%}]"
                           for n in names)
        rows.append(f"| {s:,} | {cells} | {', '.join(verdicts)} |")
    rows += ["", *(f"{n}: {k} of {m} evaluations within {names[0]}'s range" for n, (k, m) in counts.items())]
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", nargs="+", action="append", required=True, metavar=("MODE", "CSV"),
                   help="a mode's name, then its runs' metrics.csv, one a seed (repeat for each mode; the first is "
                        "the reference)")
    p.add_argument("--samples_per_step", type=int, required=True, help="data.batch_size x num_generations")
    p.add_argument("--out", help="the plot (PNG)")
    args = p.parse_args(argv)
    if len(args.run) < 2 or any(len(r) < 2 for r in args.run):
        p.error("give at least two modes, each as --run NAME CSV [CSV ...]")
    modes = {r[0]: points(r[1:], args.samples_per_step) for r in args.run}
    print(table(modes))
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (name, pts), runs in zip(modes.items(), args.run):
            x = [q.samples for q in pts]
            ax.plot(x, [q.mean for q in pts], marker="o", label=f"{name} (mean of {len(runs) - 1} seeds)")
            ax.fill_between(x, [q.low for q in pts], [q.high for q in pts], alpha=0.2)
        ax.set(xlabel="samples trained", ylabel="held-out greedy accuracy", title="eval/accuracy, seeds' range shaded")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.savefig(args.out, dpi=90, bbox_inches="tight")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
