"""The Llama-family decoder, its config, weight loading and tokenizer.

Never imports triton, engine, kernels or service: attention is delegated to an AttentionBackend
and the fused elementwise kernels come in as FusedOps, both supplied by the model's owner
(tests/test_layering.py holds this).
"""

from model import smoothing
from model.attention import AttentionBackend, BatchedCausalAttention, DenseCausalAttention
from model.config import ModelConfig, as_token_ids
from model.layers import FusedOps
from model.llama import LlamaForCausalLM
from model.loader import load_model, read_generation_config
from model.tokenizer import Tokenizer, TooManyTokens

__all__ = [
    "AttentionBackend",
    "BatchedCausalAttention",
    "DenseCausalAttention",
    "FusedOps",
    "LlamaForCausalLM",
    "ModelConfig",
    "Tokenizer",
    "TooManyTokens",
    "as_token_ids",
    "load_model",
    "read_generation_config",
    "smoothing",
]
