"""The `rlcu` command, on LightningCLI (jsonargparse).

    rlcu run RECIPE [--section.key=value ...]   run a recipe by name (rlcu recipes) or YAML path
    rlcu eval RECIPE [--ckpt_path CKPT | --model.model=HF_FOLDER]   held-out evaluation (data.val_size rows)
    rlcu fit --config FILE.yaml [...]           LightningCLI's own subcommands (fit, validate, ...)
    rlcu generate --input P.jsonl --output O.jsonl [--model M --rollout native --temperature 0 ...]
    rlcu export CKPT DIR                        a checkpoint's policy as an HF folder (safetensors, tokenizer)
    rlcu bench rollout|step [--sequences N | --prompts P --generations G] [--new_tokens L ...]
    rlcu plugins                                rewards and rollout backends found through entry points
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
    for kind in plugins.GROUPS:
        print(f"{kind} ({plugins.GROUPS[kind]}):")
        for name, ep in sorted(plugins.available(kind).items()):
            dist = ep.dist.name if ep.dist else "?"
            print(f"  {name:<22} {ep.value:<45} from {dist}")


def print_recipes() -> None:
    for name, cfg in sorted(recipes().items()):
        print(f"  {name:<14} {describe(cfg)}")
        print(f"  {'':<14} {cfg}")


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
            check_sections(self.config[self.subcommand] if self.subcommand else self.config)

    # LightningCLI reads the args from sys.argv, and so does the DDP launcher when it starts the other ranks
    # (`python -m rlcu.cli fit --config ...`): both must see the expanded command, not `run RECIPE`
    argv, sys.argv = sys.argv, [sys.argv[0], *args]
    cli_args = None
    if parse_only and args and args[0] in ("fit", "validate"):  # no subcommand to run: its config alone
        cli_args, run = args[1:], False
    try:
        return RLCUCLI(GRPOModule, PromptDataModule, run=run, args=cli_args, save_config_kwargs={"overwrite": True},
                       parser_kwargs={"default_env": False, "allow_abbrev": False}, auto_configure_optimizers=False,
                       # atomic, checksummed saves and clear errors for corrupt checkpoints
                       trainer_defaults={"plugins": [{"class_path": "rlcu.checkpoint.AtomicCheckpointIO"}]})
    finally:
        sys.argv = argv


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
    loggers = cfg.trainer.logger
    if isinstance(loggers, list) and not wandb_available():
        kept = [lg for lg in loggers if "WandbLogger" not in str(getattr(lg, "class_path", ""))]
        if len(kept) != len(loggers):
            print("rlcu: wandb is not installed; logging without it (pip install wandb)", file=sys.stderr)
            cfg.trainer.logger = kept


def user_errors() -> tuple[type[BaseException], ...]:
    from rlcu.rewards.base import RewardError

    return (plugins.UnknownPluginError, RewardError, FileNotFoundError, KeyError, ValueError, TypeError)


def expand_run(argv: list[str]) -> list[str]:
    """`run RECIPE ARGS...` is `fit --config RECIPE_YAML ARGS...` and `eval RECIPE ARGS...` is LightningCLI's
    `validate` on the same config; anything else passes through."""
    subcommands = {"run": "fit", "eval": "validate"}
    if not argv or argv[0] not in subcommands:
        return argv
    if len(argv) < 2 or argv[1].startswith("-"):
        raise ValueError(f"usage: rlcu {argv[0]} RECIPE [--section.key=value ...]; recipes: "
                         f"{', '.join(sorted(recipes()))}")
    return [subcommands[argv[0]], "--config", str(find_recipe(argv[1]))] + argv[2:]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage:\n{USAGE}\n\nLightningCLI subcommands: fit, validate, test, predict (rlcu fit --help)")
        return
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
        if argv[0] == "bench":
            from rlcu.bench import run as bench

            bench(argv[1:])
            return
        build_cli(expand_run(argv))
    except SystemExit as e:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(e, SIGTERMException):  # Lightning's stop on SIGTERM carries code None, which exits 0
            print("rlcu: stopped by SIGTERM (exit code 143, as a signal death would give)", file=sys.stderr)
            sys.exit(128 + signal.SIGTERM)
        raise
    except user_errors() as e:
        if os.environ.get("RLCU_DEBUG"):
            raise
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"rlcu: error: {message}\n(set RLCU_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
