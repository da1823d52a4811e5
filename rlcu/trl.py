"""A TRL user's GRPO run in rlcu: a `GRPOConfig` (or its fields as a `trl grpo` YAML gives them) and what TRL's
GRPOTrainer takes, as rlcu's module, data and trainer, with TRL's defaults for what the config leaves out:

    module, data, trainer = rlcu.trl.from_trl(GRPOConfig(...), train_dataset=dataset, reward_funcs=[...],
                                              model="Qwen/Qwen3-0.6B")
    trainer.fit(module, data)

Each field that was set is printed with what became of it (`rlcu.grpo.trl_config`; docs/from-trl.md)."""
from __future__ import annotations

import sys
from typing import Any

from rlcu.grpo.trl_config import Translation, field_table, translate

__all__ = ["Translation", "field_table", "from_trl", "translate"]


def _build(spec: dict):
    from rlcu.plugins import import_path

    return import_path(spec["class_path"])(**spec.get("init_args", {}))


def from_trl(config: Any, train_dataset: Any = None, reward_funcs: Any = None, model: Any = None,
             print_mapping: bool = True, **module_arguments):
    """(GRPOModule, PromptDataModule, lightning Trainer) of a TRL GRPO config, seeded as TRL seeds (its `seed`)."""
    import lightning.pytorch as L

    from rlcu.data.module import PromptDataModule
    from rlcu.grpo.module import GRPOModule

    translation = translate(config)
    if print_mapping:
        print("rlcu: the TRL config, as rlcu's (fields it leaves out take TRL's defaults):", file=sys.stderr)
        for line in translation.lines:
            print(f"  {line}", file=sys.stderr)
    L.seed_everything(translation.seed, verbose=False)
    given = {k: v for k, v in dict(model=model, reward_funcs=reward_funcs).items() if v is not None}
    module = GRPOModule(**{**translation.model, **given, **module_arguments})
    data = dict(translation.data, **({"dataset": train_dataset} if train_dataset is not None else {}))
    trainer_args = dict(translation.trainer)
    trainer_args["logger"] = [_build(s) for s in trainer_args.get("logger", [])]
    trainer_args["callbacks"] = [_build(s) for s in trainer_args.get("callbacks", [])]
    return module, PromptDataModule(**data), L.Trainer(**trainer_args)
