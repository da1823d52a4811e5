"""rlcu: GRPO for LLMs on PyTorch Lightning, with rollouts on the module's own parameters."""
__version__ = "0.1.0"
