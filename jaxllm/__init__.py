"""jaxllm: train and serve decoder-only LLMs in JAX.

    import jaxllm
    cfg = jaxllm.load_config("configs/tiny.yaml", overrides=["model.n_layers=2"])
    model = jaxllm.build_model(cfg.model, rngs=flax.nnx.Rngs(0))
    logits = model(tokens)                      # int32 [B, S] -> float32 [B, S, V]
    texts = jaxllm.generate(model, cfg, ["def fib("], max_new_tokens=64)
    reply = jaxllm.chat(model, cfg, [{"role": "user", "content": "hi"}])  # chat template
"""
from jaxllm.config import Config, ConfigError, load_config, save_config
from jaxllm.model import build_model
from jaxllm import chat  # a callable module: jaxllm.chat(model, cfg, messages)


def generate(*args, **kwargs):
    """High-level generation; see `jaxllm.inference.generate.generate`."""
    from jaxllm.inference.generate import generate as _generate
    return _generate(*args, **kwargs)


def __getattr__(name):  # `jaxllm.hf` without importing it (and its deps) eagerly
    if name == "hf":
        import importlib
        return importlib.import_module("jaxllm.hf")
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "load_config", "save_config", "build_model", "generate", "chat"]
