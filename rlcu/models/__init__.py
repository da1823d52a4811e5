from rlcu.models.config import ModelConfig, UnsupportedModelError
from rlcu.models.llama import CausalLM
from rlcu.models.loading import load_model, save_pretrained

__all__ = ["CausalLM", "ModelConfig", "UnsupportedModelError", "load_model", "save_pretrained"]
