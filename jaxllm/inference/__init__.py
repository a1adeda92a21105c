"""Inference: sampling, cached decoding, paged KV cache, speculative decoding."""
