"""The rlcu command: shipped configs parse, sweep agents' argument lines are accepted, and bad input
gets a clear error."""
import csv
import json
import os
from pathlib import Path

import pytest
import yaml

from rlcu import cli
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(ROOT.glob("recipes/*/config.yaml")) + sorted(p for p in ROOT.glob("configs/*/*.yaml")
                                                              if p.parent.name != "sweeps")


def parse(argv):
    return cli.build_cli(cli.expand_run(argv), parse_only=True).config


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_parses(path):
    header = path.read_text().splitlines()[0]
    assert header.startswith("# "), f"{path} needs a header comment saying what it is"
    parse(["fit", "--config", str(path)])


def test_recipes_say_command_hardware_and_expected_result():
    for path in ROOT.glob("recipes/*/config.yaml"):
        head = path.read_text().split("\nseed_everything")[0]
        for word in ("Command:", "Hardware:", "Expected:"):
            assert word in head, f"{path}: header lacks {word}"
        assert (path.parent / "README.md").exists(), f"{path.parent} has no README"


def test_fragments_compose_and_overrides_win():
    cfg = parse(["fit", "--config", str(ROOT / "recipes/quickstart/config.yaml"),
                 "--config", str(ROOT / "configs/trainer/cpu.yaml"),
                 "--config", str(ROOT / "configs/rewards/countdown.yaml"), "--model.learning_rate=3e-6"])
    assert cfg.trainer.accelerator == "cpu" and cfg.model.learning_rate == 3e-6
    assert cfg.model.rewards[0] == "countdown" and cfg.model.num_generations == 4  # the rest from the recipe


@pytest.mark.parametrize("strategy,expected", [([], False), (["--trainer.strategy=fsdp2"], False),
                                               (["--trainer.strategy=tp"], True),
                                               (["--trainer.strategy=rlcu.FSDP2Strategy",
                                                 "--trainer.strategy.tensor_parallel_size=2"], True),
                                               (["--trainer.strategy=tp", "--model.low_cpu_mem_usage=false"], False)])
def test_tensor_parallel_runs_read_the_model_one_rank_at_a_time(strategy, expected):
    """Under tensor parallelism each rank would read the whole model before keeping its share: the command turns
    low_cpu_mem_usage on there, unless the command line says otherwise."""
    argv = ["fit", "--config", str(ROOT / "recipes/quickstart/config.yaml"), *strategy]
    assert parse(argv).model.low_cpu_mem_usage is expected


def test_run_expands_to_fit_with_the_recipe():
    argv = cli.expand_run(["run", "quickstart", "--model.temperature=0.7"])
    assert argv[:2] == ["fit", "--config"] and argv[2].endswith("recipes/quickstart/config.yaml")
    with pytest.raises(FileNotFoundError, match="unknown recipe 'quikstart'; available: .*quickstart"):
        cli.expand_run(["run", "quikstart"])


def sweep_argument_lines(sweep: dict) -> list[list[str]]:
    """What a wandb agent substitutes for ${args}: one `--name=value` per parameter (here: each listed
    value in turn, and the bounds of distributions)."""
    lines = []
    params = sweep["parameters"]
    width = max(len(p.get("values", [0])) for p in params.values())
    for i in range(width):
        line = []
        for name, p in params.items():
            if "value" in p:
                value = p["value"]
            else:
                value = p["values"][i % len(p["values"])] if "values" in p else p["min" if i % 2 else "max"]
            line.append(f"--{name}={value}")
        lines.append(line)
    return lines


def test_wandb_sweep_argument_lines_are_accepted():
    sweep = yaml.safe_load((ROOT / "configs/sweeps/quickstart.yaml").read_text())
    assert sweep["program"] == "rlcu" and sweep["metric"]["name"] == "reward"
    command = [c for c in sweep["command"] if c not in ("${program}", "${args}")]
    for line in sweep_argument_lines(sweep):
        cfg = parse(command + line)
        for arg in line:
            key, value = arg[2:].split("=", 1)
            section, field = key.split(".")
            assert str(cfg[section][field]) == value or float(cfg[section][field]) == float(value)


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    return exit_info.value.code, capsys.readouterr().err


def test_unknown_config_key_and_wrong_type(capsys):
    code, err = run_main(["run", "quickstart", "--model.lerning_rate=1e-5"], capsys)
    assert code == 2 and "model.lerning_rate" in err
    # a truncated name is no abbreviation either (argparse would take it for the only option it begins)
    code, err = run_main(["run", "quickstart", "--model.learning_rat=1e-5"], capsys)
    assert code == 2 and "model.learning_rat" in err
    code, err = run_main(["run", "quickstart", "--model.num_generations=many"], capsys)
    assert code == 2 and "num_generations" in err and "many" in err


@pytest.fixture
def tiny_model(tmp_path):
    return str(tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                              chat_template=CHAT_TEMPLATE))


def fast_run(tiny_model, tmp_path, *extra):
    return ["run", "quickstart", f"--model.model={tiny_model}", "--model.max_completion_length=4",
            "--trainer.max_steps=2", "--trainer.logger+=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}",
            "--trainer.enable_progress_bar=false", "--model.max_prompt_length=64", *extra]


def test_a_sampler_seed_other_than_the_data_seed_runs_and_logs_both(capsys, tiny_model, tmp_path, monkeypatch):
    """Lightning merges the data module's hyperparameters with the module's for the loggers, and refused a run whose
    two `seed`s differ (rlcu run quickstart --model.seed=42 ended in a traceback); the data seed is data_seed."""
    monkeypatch.chdir(tmp_path)
    cli.main(fast_run(tiny_model, tmp_path, "--model.seed=42", "--trainer.max_steps=1"))
    hparams = next(tmp_path.glob("lightning_logs/version_*/hparams.yaml")).read_text()
    assert "\nseed: 42" in hparams and "\ndata_seed: 0" in hparams


def test_unknown_plugin_lists_available(capsys, tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(fast_run(tiny_model, tmp_path, "--model.rewards=[math_answr]"), capsys)
    assert code == 2 and "unknown reward 'math_answr'; available:" in err and "math_answer" in err


def test_a_plugin_set_key_by_key_or_with_a_wrong_engine_setting_is_one_line(capsys, tiny_model, tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(fast_run(tiny_model, tmp_path, "--model.rollout.init_args.engine.release_memory=false"),
                         capsys)
    assert code == 2 and err.count("rlcu: error:") == 1
    assert ("model.rollout takes one value, not keys under it (engine.release_memory=false); give it whole, as "
            "--model.rollout='{name: NAME, init_args: {engine: {release_memory: false}}}'") in err
    code, err = run_main(fast_run(tiny_model, tmp_path,
                                  "--model.rollout={name: native, init_args: {engine: {beside_priority: high}}}"),
                         capsys)
    assert code == 2 and "beside_priority must be an integer CUDA stream priority" in err and "'high'" in err


def test_missing_dataset_column_is_an_error_before_training(capsys, tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = Path(__file__).resolve().parents[1] / "fixtures" / "no_prompt.jsonl"
    code, err = run_main(fast_run(tiny_model, tmp_path, f"--data.dataset={data}", "--data.dataset_args=null"), capsys)
    assert code == 2 and "lacks the column(s) ['prompt']" in err


def test_prompt_longer_than_allowed_is_an_error_at_setup(capsys, tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(fast_run(tiny_model, tmp_path, "--model.max_prompt_length=5"), capsys)
    assert code == 2 and "more than max_prompt_length=5" in err


def test_plugins_lists_the_third_party_reward_and_a_recipe_uses_it(capsys, tiny_model, tmp_path, monkeypatch):
    cli.main(["plugins"])
    out = capsys.readouterr().out
    assert "repetition_penalty" in out and "from rlcu-repetition" in out
    assert "environments (rlcu.environments):" in out and "guess_number" in out and "from rlcu-guess-number" in out
    monkeypatch.chdir(tmp_path)
    cli.main(fast_run(tiny_model, tmp_path, "--model.rewards=[math_answer, repetition_penalty]"))
    metrics = list(csv.DictReader(open(next(tmp_path.glob("**/metrics.csv")))))
    assert any(r.get("rewards/repetition_penalty/mean") for r in metrics)


def test_recipes_lists_the_shipped_ones(capsys):
    cli.main(["recipes"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("quickstart", "countdown", "gsm8k", "calculator", "guess-number"))


@pytest.mark.slow
def test_quickstart_recipe_end_to_end(smollm2_folder, tmp_path):
    """The README's main job on the real model, as `make quickstart` runs it (a process of its own): 5 steps, CSV +
    offline wandb, plot, table, saved config, and no warning on stderr that a user cannot act on."""
    import subprocess
    import sys

    env = dict(os.environ, WANDB_SILENT="false")
    env.pop("WANDB_API_KEY", None)
    done = subprocess.run([sys.executable, "-m", "rlcu.cli", "run", "quickstart"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("litlogger", "LeafSpec", "anonymous setting", "does not have many workers", "Warning:",
                  "DeprecationWarning", "FutureWarning", "UserWarning"):
        assert noise not in done.stderr, noise
    run = next((tmp_path / "runs" / "quickstart").glob("version_*"))
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("reward")]
    assert len(rows) == 5 and all(r["rewards/math_answer/mean"] != "" for r in rows)
    assert (run / "curves.png").stat().st_size > 10_000
    assert (run / "config.yaml").exists() and "smollm2-135m-instruct" in (run / "config.yaml").read_text()
    table = [json.loads(line) for line in open(run / "completions.jsonl")]
    assert {"prompt", "completion", "math_answer", "overlong_penalty", "advantage"} <= set(table[0])
    assert list((tmp_path / "runs" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_lightning_sees_the_expanded_command_in_sys_argv(monkeypatch):
    """Lightning's DDP launcher starts ranks 1..N-1 by re-running sys.argv, so while the CLI runs sys.argv
    must be the expanded `fit --config RECIPE ...` (a bare `rlcu` would only print the usage there)."""
    import sys

    from lightning.pytorch.cli import LightningCLI

    seen, parse_arguments = [], LightningCLI.parse_arguments

    def spy(self, parser, args):
        seen.append(list(sys.argv))
        return parse_arguments(self, parser, args)

    monkeypatch.setattr(LightningCLI, "parse_arguments", spy)
    before = list(sys.argv)
    config = parse(["run", "quickstart", "--trainer.max_steps=3"])
    assert seen[0][1:] == ["fit", "--config", str(cli.find_recipe("quickstart")), "--trainer.max_steps=3"]
    assert config.trainer.max_steps == 3 and sys.argv == before


def test_the_private_lightning_parts_rlcu_relies_on_still_exist():
    """cli.py overrides LightningCLI._parse_ckpt_path, strategies.py sets ModelParallelStrategy's
    _data_parallel_size and callbacks/progress.py overrides RichProgressBar._get_train_description: no public
    hook does any of these. Tested with Lightning 2.5-2.6 (pyproject pins <2.7)."""
    import inspect

    import lightning
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.strategies import ModelParallelStrategy
    from packaging.version import Version

    assert Version("2.5") <= Version(lightning.__version__) < Version("2.7")
    assert "hyper_parameters" in inspect.getsource(LightningCLI._parse_ckpt_path)
    assert "_data_parallel_size" in inspect.getsource(ModelParallelStrategy.setup_environment)
    from lightning.pytorch.callbacks import RichProgressBar  # rlcu.callbacks.StepProgressBar relabels its bar

    assert "max_epochs - 1" in inspect.getsource(RichProgressBar._get_train_description)


def test_runs_save_through_the_atomic_checksummed_checkpoint_io_by_default():
    plugins = parse(["run", "quickstart"]).trainer.plugins
    assert [p.class_path for p in plugins] == ["rlcu.checkpoint.AtomicCheckpointIO"]


def test_version_and_an_unknown_command(capsys):
    from importlib.metadata import version

    cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"rlcu {version('rlcu')}"
    code, err = run_main(["foo"], capsys)
    assert code == 2 and "unknown command 'foo'; commands: run, eval, generate, export, bench" in err


def test_bench_json_has_no_nan():
    import json

    from rlcu.bench import finite

    line = json.dumps(finite({"loss": float("nan"), "steps": [1.0, float("inf")], "ok": 2}), allow_nan=False)
    assert json.loads(line) == {"loss": None, "steps": [1.0, None], "ok": 2}


def test_a_command_ends_the_process_group_it_ran_in(tmp_path, capsys):
    """torchrun ranks that leave the group to the exit handlers can abort in gloo's threads after their work."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    cli.main(["recipes"])
    assert "arithmetic" in capsys.readouterr().out
    assert not dist.is_initialized()


def test_a_reader_that_leaves_early_ends_the_listing_quietly(tmp_path):
    """`rlcu plugins | head -1`: the pipe's reader goes before rlcu writes, which exits as a shell's SIGPIPE death
    (141) with nothing on stderr, where it printed "rlcu: error: [Errno 32] Broken pipe"."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    read, write = os.pipe()
    os.close(read)  # no reader: the first write fails
    done = subprocess.run([sys.executable, "-m", "rlcu.cli", "plugins"], stdout=write, stderr=subprocess.PIPE,
                          text=True, env=dict(os.environ, PYTHONPATH=root), timeout=120, cwd=tmp_path)
    os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr[-2000:]
