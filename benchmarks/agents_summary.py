"""The short table of benchmarks/agents_h200.sh: whatever parts of it ran, from the files under OUT."""
import csv
import json
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return list(csv.DictReader(open(path))) if path.exists() else []


def series(table: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in table if r.get(key) not in (None, "")]


def main(out: Path) -> None:
    for n in (64, 512):
        one, four = out / f"rollout-{n}-turns1.json", out / f"rollout-{n}-turns4.json"
        if one.exists() and four.exists():
            a, b = json.loads(one.read_text()), json.loads(four.read_text())
            print(f"rollout {n} x 512: 1 turn {a['tok_per_s']:,} tok/s, 4 turns {b['tok_per_s']:,} tok/s "
                  f"({b['tok_per_s'] / a['tok_per_s']:.0%})")
    for name, accuracy in (("calculator", "eval/accuracy"), ("calculator-agent", "eval/accuracy"),
                           ("guess", "eval/accuracy")):
        table = rows(out / f"{name}-metrics.csv")
        if table:
            acc, steps = series(table, accuracy), series(table, "step")
            # the program's calls per episode (2: it called the tool and answered), else tool calls per episode
            calls = series(table, "episodes/mean_calls") or series(table, "tools/call_frequency")
            turns = series(table, "episodes/mean_turns")
            print(f"{name}: {int(max(steps, default=0))} steps, held-out greedy accuracy {acc[:1]} -> {acc[-1:]}, "
                  f"calls/episode {calls[:1]} -> {calls[-5:]}, turns {turns[:1]} -> {turns[-3:]}")
    trl = rows(out / "calculator-trl.csv")
    if trl:
        print(f"TRL calculator: {trl[-1]['step']} steps in {trl[-1]['seconds']} s, reward {trl[0]['reward']} -> "
              f"{trl[-1]['reward']}, tool calls/episode {trl[0].get('tools/call_frequency')} -> "
              f"{trl[-1].get('tools/call_frequency')}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
