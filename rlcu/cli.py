"""The `rlcu` command, on LightningCLI (jsonargparse).

    rlcu run RECIPE [--section.key=value ...]   run a recipe by name (rlcu recipes) or YAML path
    rlcu run --trl_config GRPO.yaml [...]       run a `trl grpo` config as it is, with TRL's defaults (docs/from-trl.md)
    rlcu eval RECIPE [--ckpt_path CKPT | --model.model=HF_FOLDER]   held-out evaluation (data.val_size rows,
                                                of data.val_split where set)
    rlcu fit --config FILE.yaml [...]           LightningCLI's own subcommands (fit, validate, ...)
    rlcu generate --input P.jsonl --output O.jsonl [--model M --rollout native --temperature 0 ...]
    rlcu export CKPT DIR                        a checkpoint's policy as an HF folder (safetensors, tokenizer)
    rlcu bench rollout|step [--sequences N | --prompts P --generations G] [--new_tokens L ...]
    rlcu plugins                                rewards, rollout backends and environments (entry points)
    rlcu recipes                                the shipped recipes

Any field can be overridden as `--model.learning_rate=1e-5` (the form wandb sweep agents pass); the
resolved config is saved as config.yaml in every run's folder."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from rlcu import plugins

USAGE = __doc__.split("\n\n")[1]
COMMANDS = ("run", "eval", "generate", "export", "bench", "plugins", "recipes", "fit", "validate", "test", "predict")
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def recipe_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("RLCU_RECIPES", "").split(os.pathsep) if p]
    return dirs + [Path.cwd() / "recipes", PACKAGE_ROOT / "recipes"]


def recipes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in recipe_dirs():
        for cfg in sorted(d.glob("*/config.yaml")) if d.is_dir() else []:
            found.setdefault(cfg.parent.name, cfg)
    return found


def find_recipe(name: str) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {name} does not exist")
        return path
    found = recipes()
    if name not in found:
        raise FileNotFoundError(f"unknown recipe {name!r}; available: {', '.join(sorted(found)) or 'none'} "
                                f"(searched {', '.join(str(d) for d in recipe_dirs())})")
    return found[name]


def describe(config: Path) -> str:
    """The first comment line of a recipe's YAML header."""
    for line in config.read_text().splitlines():
        if line.startswith("#") and line.strip("# ").strip():
            return line.strip("# ").strip()
    return ""


def print_plugins() -> None:
    from rlcu.grpo import registry

    losses, estimators = registry.builtin()
    for kind in plugins.GROUPS:
        print(f"{kind} ({plugins.GROUPS[kind]}):")
        if kind == "losses":  # the built-ins are registered records, not entry points
            for record in [*losses.values(), *estimators.values()]:
                what = "loss_type" if isinstance(record, registry.LossType) else "advantage_estimator"
                print(f"  {record.name:<22} {what:<45} built in: {record.help}")
        for name, ep in sorted(plugins.available(kind).items()):
            dist = ep.dist.name if ep.dist else "?"
            print(f"  {name:<22} {ep.value:<45} from {dist}")


def print_recipes() -> None:
    found = sorted(recipes().items())
    width = max((len(name) for name, _ in found), default=0)  # one column whatever the longest name
    for name, cfg in found:
        print(f"  {name:<{width}} {describe(cfg)}")
        print(f"  {'':<{width}} {cfg}")


def build_cli(args: list[str], run: bool = True, parse_only: bool = False):
    """The LightningCLI. `parse_only` validates and resolves a config without building the model, data
    and trainer (for tests of shipped configs and of sweep argument lines); its `config` is the
    subcommand's."""
    from lightning.pytorch.cli import LightningCLI

    from rlcu.data.module import PromptDataModule
    from rlcu.grpo.module import GRPOModule

    explicit = explicit_model_flags(args)

    class RLCUCLI(LightningCLI):
        def instantiate_classes(self) -> None:
            if not parse_only:
                super().instantiate_classes()

        # Lightning has no public hook between reading a checkpoint's hyper-parameters and building the
        # module; tests/unit/test_cli.py pins the Lightning versions this override was tested with
        def _parse_ckpt_path(self) -> None:
            from rlcu.checkpoint import CorruptCheckpointError, verify

            sub = self.config.get("subcommand")
            given = {k: self.config[sub].model[k] for k in explicit} if sub else {}
            ckpt = self.config[sub].get("ckpt_path") if sub else None
            try:  # LightningCLI reads the checkpoint's hyper-parameters here, before rlcu's CheckpointIO sees it
                if ckpt and Path(ckpt).is_file():
                    verify(ckpt)
                super()._parse_ckpt_path()
            except CorruptCheckpointError:
                raise
            except (FileNotFoundError, PermissionError):
                raise
            except Exception as e:
                raise CorruptCheckpointError(self.config[sub].get("ckpt_path"), e) from None
            for key, value in given.items():  # the command line wins over the checkpoint's saved values
                saved = self.config[sub].model[key]
                if saved != value:
                    print(f"rlcu: --model.{key}={value} overrides the checkpoint's {saved!r}", file=sys.stderr)
                    self.config[sub].model[key] = value

        def before_instantiate_classes(self) -> None:
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            check_sections(cfg)
            if not parse_only:  # a config that names a GPU parses anywhere; it runs only where there is one
                check_accelerator(cfg)
            load_shares_alone(cfg, explicit)

        def after_instantiate_classes(self) -> None:
            global _trainer
            _trainer = getattr(self, "trainer", None)  # for clean-up if the run fails

    # LightningCLI reads the args from sys.argv, and so does the DDP launcher when it starts the other ranks
    # (`python -m rlcu.cli fit --config ...`): both must see the expanded command, not `run RECIPE`
    argv, sys.argv = sys.argv, [sys.argv[0], *args]
    cli_args = None
    if parse_only and args and args[0] in ("fit", "validate"):  # no subcommand to run: its config alone
        cli_args, run = args[1:], False
    try:
        return RLCUCLI(GRPOModule, PromptDataModule, run=run, args=cli_args, save_config_kwargs={"overwrite": True},
                       parser_kwargs={"default_env": False, "allow_abbrev": False, "exit_on_error": False},
                       auto_configure_optimizers=False,
                       # atomic, checksummed saves and clear errors for corrupt checkpoints
                       trainer_defaults={"plugins": [{"class_path": "rlcu.checkpoint.AtomicCheckpointIO"}]})
    finally:
        sys.argv = argv


def add_progress_bar(cfg) -> None:
    """rlcu's progress bar (`StepProgressBar`) where the run shows one and its config names none."""
    import importlib.util

    from jsonargparse import Namespace

    trainer = cfg.trainer
    if trainer.get("enable_progress_bar") is False or importlib.util.find_spec("rich") is None:
        return
    callbacks = trainer.callbacks if isinstance(trainer.callbacks, list) else [c for c in [trainer.callbacks] if c]
    if any("ProgressBar" in str(getattr(c, "class_path", c)) for c in callbacks):
        return
    trainer.callbacks = callbacks + [Namespace(class_path="rlcu.callbacks.StepProgressBar", init_args=Namespace())]


def check_output_folders(cfg) -> None:
    """Where the run writes (the trainer's root, each logger's save_dir) takes files, before anything starts; the
    folders made for the check go again (the run makes them as it writes)."""
    from rlcu.paths import check_writable_folder

    trainer = cfg.trainer
    if trainer.get("default_root_dir"):
        check_writable_folder(trainer.default_root_dir, "--trainer.default_root_dir", keep=False)
    loggers = trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]
    for lg in loggers:
        save_dir = getattr(getattr(lg, "init_args", None), "save_dir", None)
        if save_dir:
            check_writable_folder(save_dir, f"the save_dir of {str(lg.class_path).rsplit('.', 1)[-1]}", keep=False)
    callbacks = trainer.callbacks if isinstance(trainer.callbacks, list) else [trainer.callbacks]
    for cb in callbacks:  # checkpoint folders: at set-up, not at the first save a step later
        dirpath = getattr(getattr(cb, "init_args", None), "dirpath", None)
        if dirpath:
            check_writable_folder(dirpath, f"the dirpath of {str(cb.class_path).rsplit('.', 1)[-1]}", keep=False)


def check_accelerator(cfg) -> None:
    """A GPU asked of a machine where torch sees none: one line naming the choices, before anything starts."""
    import torch

    accelerator = cfg.trainer.get("accelerator")
    if isinstance(accelerator, str) and accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"--trainer.accelerator={accelerator}: torch sees no GPU on this machine (torch "
                         f"{torch.__version__}); use --trainer.accelerator=cpu, or auto to take a GPU where there "
                         "is one")


def explicit_model_flags(args: list[str]) -> list[str]:
    """The module options set on the command line (`--model.learning_rate=1e-5` or `--model.learning_rate 1e-5`)."""
    keys = []
    for arg in args:
        if arg.startswith("--model."):
            key = arg[len("--model."):].split("=", 1)[0].split(".", 1)[0]
            if key and key not in keys:
                keys.append(key)
    return keys


def check_sections(cfg) -> None:
    """Each section a mapping; wandb left out, with a word, where it is not installed."""
    from jsonargparse import Namespace

    from rlcu.loggers import wandb_available

    for section in ("trainer", "model", "data"):
        if section in cfg and not isinstance(cfg[section], Namespace):
            raise ValueError(f"the config's '{section}' section must be a mapping of settings, got "
                             f"{cfg[section]!r}; leave it out for the defaults")
    check_output_folders(cfg)
    check_whole_plugins(cfg)
    add_progress_bar(cfg)
    loggers = cfg.trainer.logger
    if isinstance(loggers, list) and not wandb_available():
        kept = [lg for lg in loggers if "WandbLogger" not in str(getattr(lg, "class_path", ""))]
        if len(kept) != len(loggers):
            print("rlcu: wandb is not installed; logging without it (pip install wandb)", file=sys.stderr)
            cfg.trainer.logger = kept


def check_whole_plugins(cfg) -> None:
    """A plugin option (rollout, rewards, ...) set key by key (--model.rollout.init_args.X=...) reaches the parser as
    jsonargparse's NestedArg, which no plugin is: say how to give it whole."""
    for name, value in vars(cfg.model).items() if "model" in cfg else ():
        if type(value).__name__ == "NestedArg":
            keys = value.key.split(".")
            nested = str(value.val)
            for key in reversed(keys[1:] if keys[0] == "init_args" else keys):
                nested = f"{{{key}: {nested}}}"
            raise ValueError(f"model.{name} takes one value, not keys under it ({value.key}={value.val}); give it "
                             f"whole, as --model.{name}='{{name: NAME, init_args: {nested}}}'")


def load_shares_alone(cfg, explicit: list[str]) -> None:
    """Under tensor parallelism (`--trainer.strategy=tp`, or rlcu.FSDP2Strategy with a tensor_parallel_size other
    than 1) every rank would read the whole model before keeping its share: `low_cpu_mem_usage` is turned on there,
    so that each rank reads its shares alone, unless the command line sets it."""
    strategy = cfg.trainer.get("strategy") if "trainer" in cfg else None
    if isinstance(strategy, str):
        split = strategy == "tp"
    else:
        path = str(getattr(strategy, "class_path", ""))
        size = getattr(getattr(strategy, "init_args", None), "tensor_parallel_size", 1)
        split = path.endswith("FSDP2Strategy") and size not in (1, "1")
    if split and "low_cpu_mem_usage" not in explicit and "model" in cfg and "low_cpu_mem_usage" in cfg.model:
        cfg.model.low_cpu_mem_usage = True


def user_errors() -> tuple[type[BaseException], ...]:
    import argparse

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from rlcu.grpo.module import TrainingFault
    from rlcu.rewards.base import RewardError

    return (plugins.UnknownPluginError, RewardError, TrainingFault, MisconfigurationException, argparse.ArgumentError,
            OSError, KeyError, ValueError, TypeError)


def did_you_mean(arg: str) -> str | None:
    """The option closest to an unknown `--section.key[=value]` among the module's, the data's and the trainer's."""
    import difflib
    import inspect

    from lightning.pytorch import Trainer

    from rlcu.data.module import PromptDataModule
    from rlcu.grpo.module import GRPOModule

    name = arg.split("=", 1)[0]
    section, _, key = name.removeprefix("--").partition(".")
    owner = {"model": GRPOModule, "data": PromptDataModule, "trainer": Trainer}.get(section)
    if owner is None or not key:
        return None
    close = difflib.get_close_matches(key.split(".")[0], inspect.signature(owner.__init__).parameters, n=1)
    return f"--{section}.{close[0]}" if close else None


def expand_run(argv: list[str]) -> list[str]:
    """`run RECIPE ARGS...` is `fit --config RECIPE_YAML ARGS...` and `eval RECIPE ARGS...` is LightningCLI's
    `validate` on the same config; anything else passes through."""
    subcommands = {"run": "fit", "eval": "validate"}
    if not argv or argv[0] not in subcommands:
        return argv
    if argv[0] == "run" and argv[1:2] and argv[1].split("=", 1)[0] == "--trl_config":
        return trl_run(argv[1:])
    if argv[0] == "run" and any(a.split("=", 1)[0] == "--trl_config" for a in argv[2:]):
        raise ValueError("--trl_config takes the place of a recipe (each is a whole config): rlcu run --trl_config "
                         "FILE [--section.key=value ...]")
    if len(argv) < 2 or argv[1].startswith("-"):
        raise ValueError(f"usage: rlcu {argv[0]} RECIPE [--section.key=value ...]; recipes: "
                         f"{', '.join(sorted(recipes()))} (rlcu {argv[0]} RECIPE --help lists every option)")
    return [subcommands[argv[0]], "--config", str(find_recipe(argv[1]))] + argv[2:]


def trl_run(args: list[str]) -> list[str]:
    """`--trl_config FILE [overrides]`: the TRL config translated (each field's fate printed), as a LightningCLI
    config in a file of its own, then `fit` on it with the overrides."""
    import tempfile

    import yaml

    from rlcu.grpo.trl_config import translate

    flag, _, path = args[0].partition("=")
    rest = args[1:] if path else args[2:]
    path = path or (args[1] if len(args) > 1 else "")
    if not path or not Path(path).is_file():
        raise FileNotFoundError(f"--trl_config needs a TRL GRPO config file (YAML), got {path or 'nothing'!r}")
    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path} is not valid YAML{where} ({getattr(e, 'problem', None) or e}): fix the file, "
                         "as `trl grpo --config` would need too") from e
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a TRL config is a mapping of GRPOConfig's fields, got {type(values).__name__}")
    translation = translate(values)
    print(f"rlcu: TRL config {path}, as rlcu's (fields it leaves out take TRL's defaults):", file=sys.stderr)
    for line in translation.lines:
        print(f"  {line}", file=sys.stderr)
    config = tempfile.NamedTemporaryFile("w", prefix="trl-", suffix=".yaml", delete=False)
    with config:
        yaml.safe_dump(translation.config(), config, sort_keys=False)
    return ["fit", "--config", config.name, *rest]


def print_run_help(command: str) -> None:
    print(f"usage: rlcu {command} RECIPE [--section.key=value ...]\n\n"
          f"{'Trains with' if command == 'run' else 'Evaluates held-out accuracy of'} a recipe: a name below or a "
          f"YAML file. Any setting can be overridden as --section.key=value;\n`rlcu {command} RECIPE --help` "
          "lists every option with its default.\n\nrecipes:")
    print_recipes()


def main(argv: list[str] | None = None) -> None:
    from rlcu import quiet

    quiet.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage:\n{USAGE}\n\nLightningCLI subcommands: fit, validate, test, predict (rlcu fit --help)")
        return
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"rlcu {version('rlcu')}")
        return
    if argv[0] not in COMMANDS:
        print(f"rlcu: error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (rlcu --help)",
              file=sys.stderr)
        sys.exit(2)
    if argv[0] in ("run", "eval") and argv[1:2] in (["-h"], ["--help"]):
        return print_run_help(argv[0])
    if os.getcwd() not in sys.path and "" not in sys.path:  # rewards by import path from here, as `python -m` allows
        sys.path.insert(0, os.getcwd())
    try:
        if argv[0] == "plugins":
            return print_plugins()
        if argv[0] == "recipes":
            return print_recipes()
        if argv[0] == "generate":
            from rlcu.generate import run

            run(argv[1:])
            return
        if argv[0] == "export":
            from rlcu.export import run as export

            export(argv[1:])
            return
        from rlcu.agents.workers import started_from_cli  # this process's main module is rlcu's: spawning is safe

        if argv[0] == "bench":
            from rlcu.bench import run as bench

            with started_from_cli():
                bench(argv[1:])
            return
        with started_from_cli():
            build_cli(expand_run(argv))
    except SystemExit as e:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(e, SIGTERMException):  # Lightning's stop on SIGTERM carries code None, which exits 0
            from rlcu.callbacks.interrupt import STOPPED_BY

            stop = signal.SIGINT if STOPPED_BY else signal.SIGTERM
            print(f"rlcu: stopped by {stop.name} (exit code {128 + stop}, as a signal death would give)",
                  file=sys.stderr)
            sys.exit(128 + stop)
        raise
    except BrokenPipeError:  # `rlcu recipes | head`: the reader left; a shell's SIGPIPE exit, not a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush finds no closed pipe
        sys.exit(128 + signal.SIGPIPE)
    except user_errors() as e:
        discard_failed_run()
        if os.environ.get("RLCU_DEBUG"):
            raise
        print(f"rlcu: error: {explain(e)} (RLCU_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)
    finally:
        close_process_group()


def close_process_group() -> None:
    """Ends the distributed run's process group while the interpreter is whole: gloo's worker threads, left to
    the exit handlers, can abort a rank that finished its work (`terminate called without an active exception`)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_trainer = None  # the trainer of the run in progress, once built


def discard_failed_run() -> None:
    if _trainer is not None:
        from rlcu.loggers import discard_empty_logs

        discard_empty_logs(_trainer)


def explain(e: BaseException) -> str:
    """One line: the error's own message, with the option it most likely meant for an unknown one."""
    import argparse

    message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if isinstance(e, OSError) and e.filename:
        message = f"cannot use {e.filename}: {e.strerror}; free space or choose another path"
    if isinstance(e, argparse.ArgumentError) and "unrecognized arguments" in message:
        hints = [did_you_mean(arg) for arg in message.split(":", 1)[1].split()]
        message += "".join(f"; did you mean {h}?" for h in hints if h)
        if not any(hints):
            message += "; `rlcu run RECIPE --help` lists every option"
    return " ".join(message.split())


if __name__ == "__main__":
    main()
