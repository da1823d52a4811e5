from rlcu.models.config import ModelConfig, UnsupportedModelError
from rlcu.models.decoder import CausalLM
from rlcu.models.loading import load_model, save_pretrained
from rlcu.models.lora import LoraSpec, add_lora, merge_lora, save_adapter

__all__ = ["CausalLM", "LoraSpec", "ModelConfig", "UnsupportedModelError", "add_lora", "load_model", "merge_lora",
           "save_adapter", "save_pretrained"]
