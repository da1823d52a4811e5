"""rlcu: GRPO for LLMs on PyTorch Lightning, with rollouts on the module's own parameters."""
__version__ = "0.1.0"

_LAZY = {"GRPOModule": "rlcu.grpo.module", "PromptDataModule": "rlcu.data.module", "load_model": "rlcu.models",
         "save_pretrained": "rlcu.models", "Reward": "rlcu.rewards", "SamplingParams": "rlcu.rollout",
         "FSDP2Strategy": "rlcu.strategies"}


def __getattr__(name):  # keeps `import rlcu` light: Lightning and transformers load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlcu' has no attribute {name!r}")


__all__ = list(_LAZY)
