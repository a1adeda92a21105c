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


def __getattr__(name):
    # `jaxllm.hf` without importing it (and its deps) eagerly; `jaxllm.generate`, the CLI
    # module, a callable one (jaxllm.generate(model, cfg, prompts)), imported on first use
    # so that `python -m jaxllm.generate` finds it not yet imported
    if name in ("hf", "generate", "plan"):  # jaxllm.plan(cfg, hardware, devices): callable
        import importlib
        return importlib.import_module(f"jaxllm.{name}")
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "load_config", "save_config", "build_model", "generate", "chat",
           "plan"]
