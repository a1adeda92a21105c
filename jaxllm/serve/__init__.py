"""The OpenAI-compatible HTTP server over the serving engine: `python -m jaxllm.serve`.

`create_app(aeng, tokenizer, model_name, cfg)` builds the FastAPI app over a started
AsyncEngine (app.py); protocol.py holds the request bodies, metrics.py the Prometheus
metrics."""
from jaxllm.serve.app import create_app

__all__ = ["create_app"]
