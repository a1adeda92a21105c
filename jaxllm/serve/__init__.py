"""The OpenAI-compatible HTTP server over the serving engine: `python -m jaxllm.serve`.

`create_app(aeng, tokenizer, model_name, cfg)` builds the FastAPI app over a started
AsyncEngine (app.py); protocol.py holds the request bodies, metrics.py the Prometheus
metrics. The serve extra (fastapi, uvicorn, prometheus-client) is imported on first use,
so the CLI can say when it is missing."""

__all__ = ["create_app"]


def __getattr__(name):
    if name == "create_app":
        from jaxllm.serve.app import create_app
        return create_app
    raise AttributeError(f"module 'jaxllm.serve' has no attribute {name!r}")
