"""Rollout throughput of a recipe run on one GPU against the same run under DDP, from their metrics.csv
(steps after the first; under DDP the logged values are means over ranks, so the total is times world).
    python3 benchmarks/ddp_throughput.py ONE_GPU/metrics.csv:1 TWO_GPUS/metrics.csv:2"""
import csv
import json
import sys


def summary(path: str, world: int) -> dict:
    rows = [r for r in csv.DictReader(open(path)) if r.get("tokens_per_second")][1:]
    if not rows:
        raise SystemExit(f"{path} has no training steps after the first")
    mean = lambda key: sum(float(r[key]) for r in rows) / len(rows)  # noqa: E731
    per_rank = mean("tokens_per_second")
    result = {"gpus": world, "steps": len(rows), "tok_per_s_per_gpu": round(per_rank),
              "tok_per_s_total": round(per_rank * world),
              "generate_s": round(mean("timing/generate"), 3), "train_s": round(mean("timing/train"), 3)}
    for phase in ("gather", "reshard"):  # fsdp2's, around each rollout
        if rows[0].get(f"timing/{phase}"):
            result[f"{phase}_s"] = round(mean(f"timing/{phase}"), 3)
    return result


if __name__ == "__main__":
    results = []
    for arg in sys.argv[1:]:
        path, world = arg.rsplit(":", 1)
        results.append(summary(path, int(world)))
        print(json.dumps(results[-1]))
    if len(results) == 2:
        print(f"scaling: {results[1]['tok_per_s_total'] / results[0]['tok_per_s_total']:.2f}x the generated tokens "
              f"per second of {results[0]['gpus']} GPU(s) with {results[1]['gpus']}")
