"""Plot a benchmark results file's GRPO step times by phase, beside the peer's step time.
    python3 benchmarks/plot.py benchmarks/results/2026-11-30-h200-3bdc9cb.json docs/benchmarks-step.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))  # one call's "runs", or several "calls" of which one is marked "of_record"
    runs = data["runs"] if "runs" in data else next(c for c in data["calls"] if c.get("of_record"))["runs"]
    bars = []
    for workload in ("GRPO step 8 x 8 x 512", "GRPO step 32 x 8 x 512"):
        ours = next(r for r in runs if r["what"] == workload and r["tool"] == "rlcu")
        peer = next(r for r in runs if r["what"] == workload and r["tool"] != "rlcu")
        steady = peer["step_seconds"][1:]
        bars.append((workload.replace("GRPO step ", ""), ours["steady"], sum(steady) / len(steady)))
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    for i, (name, phases, trl) in enumerate(bars):
        left = 0.0
        for phase, colour in (("generate", "#4c72b0"), ("score", "#dd8452"), ("train", "#55a868")):
            ax.barh(2 * i, phases[phase], left=left, color=colour, label=phase if i == 0 else None)
            left += phases[phase]
        ax.barh(2 * i + 0.8, trl, color="#8c8c8c", label="TRL 1.16 (whole step)" if i == 0 else None)
        ax.text(left + 0.3, 2 * i, f"rlcu {phases['total']:.2f} s", va="center", fontsize=8)
        ax.text(trl + 0.3, 2 * i + 0.8, f"TRL {trl:.1f} s", va="center", fontsize=8)
    ax.set_xlim(0, max(b[2] for b in bars) * 1.15)  # room for the labels
    ax.set_yticks([0.4, 2.4], [b[0] for b in bars])
    ax.set_xlabel("seconds per GRPO step (steady state), one H200, Qwen3-0.6B shape")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
