"""Two runs' metrics.csv, step by step: every logged value equal to the last digit, apart from wall-clock
ones (timing/*, tokens_per_second, memory/*). Prints the first difference, or how many steps and values
agreed. python3 benchmarks/same_metrics.py RUN_A/metrics.csv RUN_B/metrics.csv"""
import csv
import sys

CLOCK = ("timing/", "tokens_per_second", "memory/")


def values(path: str) -> list[dict[str, str]]:
    rows = list(csv.DictReader(open(path)))
    return [{k: v for k, v in r.items() if v != "" and not k.startswith(CLOCK)} for r in rows]


def main(a: str, b: str) -> int:
    ra, rb = values(a), values(b)
    if len(ra) != len(rb):
        print(f"different row counts: {len(ra)} and {len(rb)}")
        return 1
    compared = 0
    for i, (x, y) in enumerate(zip(ra, rb)):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                print(f"first difference: row {i} (step {x.get('step')}), {key}: {x.get(key)} != {y.get(key)}")
                return 1
            compared += 1
    steps = len({r.get("step") for r in ra})
    print(f"identical: {compared} values over {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
