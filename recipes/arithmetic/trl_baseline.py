"""The arithmetic recipe through TRL's GRPOTrainer (recipes/trl_baseline.py with RECIPE=arithmetic).

    python recipes/arithmetic/trl_baseline.py --out runs/arithmetic-trl.csv [--max_steps 200] [--model PATH]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trl_baseline import main as run  # noqa: E402


def main(argv=None):
    return run(["arithmetic", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
