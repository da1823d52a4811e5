"""recipes/seed_curves.py: the seeds' mean and range per mode, and the verdict against the first mode's range."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "seed_curves.py"


def load():
    spec = importlib.util.spec_from_file_location("seed_curves", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, accuracies: dict[int, float], extra_step: int | None = None) -> str:
    rows = ["step,reward,eval/accuracy"]
    for step, acc in accuracies.items():
        rows += [f"{step},,{acc}", f"{step},0.5,"]  # Lightning's CSV: evaluation and training on rows of their own
    if extra_step is not None:
        rows.append(f"{extra_step},,0.99")  # evaluated by this seed only: left out
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_table_gives_each_modes_mean_and_range_and_the_verdict(tmp_path, capsys):
    """Modes evaluated at other steps (a streaming run's first steps only fill the stream) are judged against the
    reference's range drawn linearly between its evaluations; points past the reference's last get no verdict."""
    curves = load()
    sync = [write(tmp_path / f"s{i}.csv", {0: a, 10: b}, extra_step=5 if i == 0 else None)
            for i, (a, b) in enumerate([(0.1, 0.5), (0.2, 0.6), (0.3, 0.8)])]
    stream = [write(tmp_path / f"t{i}.csv", {0: a, 7: b, 12: c})
              for i, (a, b, c) in enumerate([(0.15, 0.4, 0.7), (0.25, 0.5, 0.8)])]
    other = [write(tmp_path / f"o{i}.csv", {0: a, 10: b}) for i, (a, b) in enumerate([(0.1, 0.9), (0.3, 1.0)])]
    curves.main(["--run", "synchronous", *sync, "--run", "streaming", *stream, "--run", "other", *other,
                 "--samples_per_step", "128", "--out", str(tmp_path / "c.png")])
    assert capsys.readouterr().out.splitlines()[:-1] == [
        "| samples trained | synchronous | streaming | other | within synchronous's range |",
        "| --- | --- | --- | --- | --- |",
        "| 0 | 20.0% [10.0%, 30.0%] | 20.0% [15.0%, 25.0%] | 20.0% [10.0%, 30.0%] | streaming: yes, other: yes |",
        "| 896 |  | 45.0% [40.0%, 50.0%] |  | streaming: yes |",  # the range there: [38%, 65%]
        "| 1,280 | 63.3% [50.0%, 80.0%] |  | 95.0% [90.0%, 100.0%] | other: no |",
        "| 1,536 |  | 75.0% [70.0%, 80.0%] |  |  |",
        "",
        "streaming: 2 of 2 evaluations within synchronous's range",
        "other: 1 of 2 evaluations within synchronous's range",
    ]
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_run_without_held_out_accuracy_is_one_line_error(tmp_path):
    curves = load()
    (tmp_path / "none.csv").write_text("step,reward\n1,0.5\n")
    good = write(tmp_path / "a.csv", {0: 0.1})
    with pytest.raises(SystemExit, match="none.csv has no eval/accuracy; run the recipe with val_check_interval"):
        curves.main(["--run", "a", good, "--run", "b", str(tmp_path / "none.csv"), "--samples_per_step", "8"])
