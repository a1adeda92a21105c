"""Flax NNX decoder models (the training form; decoding runs `jaxllm.inference`)."""
from jaxllm.model.decoder import Decoder, build_model

__all__ = ["Decoder", "build_model"]
