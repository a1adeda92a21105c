"""Flax NNX decoder models."""
from jaxllm.model.attention import KVCache
from jaxllm.model.decoder import Decoder, build_model

__all__ = ["Decoder", "KVCache", "build_model"]
