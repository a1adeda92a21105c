"""python -m jaxllm.serve (--run RUN_DIR | --hf HF_DIR) [--step N] [--host H] [--port P]
[--served-model-name NAME] [--hardware NAME] [section.key=value ...]

Loads a model as `python -m jaxllm.generate` does, builds the serving engine
(inference.engine.* overrides size it, e.g. inference.engine.num_pages=256; it compiles its
steps before the first request), prints the planner's figures beside the engine's
(`jaxllm.plan.describe_serving`: KV cache, page pool, weights, the compiled step's memory,
predicted TTFT and TPOT on the detected or named GPU), and serves the OpenAI API
(/v1/completions, /v1/chat/completions, /v1/models) with /health and /metrics until SIGINT
or SIGTERM.
"""
from __future__ import annotations

import argparse
import gc
import signal
import socket
import sys


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxllm.serve",
                                 description="Serve a jaxllm model over the OpenAI HTTP API.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory (config.yaml + checkpoints/)")
    src.add_argument("--hf", help="Hugging Face model directory (config.json, *.safetensors, "
                                  "tokenizer.json)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default="jaxllm",
                    help="the model's name in the API: requests naming another model get a "
                         "404 (default: jaxllm)")
    ap.add_argument("--hardware", default=None,
                    help="the GPU whose planned pool, TTFT and TPOT print beside the engine's "
                         "at start-up (h100, h200, ...; default: the detected device, none on "
                         "a CPU)")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return ap


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) (port 0: a free one); ValueError if that fails."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another "
                         f"--port or --host") from e
    return sock


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from absl import logging as absl_logging  # orbax notes read-only restores at WARNING
    absl_logging.set_verbosity(absl_logging.ERROR)
    from jaxllm.checkpoint import check_run_dir, load_model
    from jaxllm.config import ConfigError, load_config

    try:
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port {args.port} must lie in [0, 65535]")
        if args.step is not None and args.hf:
            raise ValueError("--step applies to --run only (an HF directory has one set of "
                             "weights)")
        if args.hardware is not None:
            from jaxllm.plan import get_hardware
            get_hardware(args.hardware)  # an unknown name is refused before the model loads
        import fastapi, prometheus_client, uvicorn  # noqa: E401,F401  (the serve extra)
        sock = listen(args.host, args.port)  # a busy port is refused before the model loads
        source = args.hf or args.run
        if args.hf:
            from jaxllm import hf
            (model, cfg), step = hf.load(args.hf, args.overrides), "-"
        else:  # the stored config first: every input is checked before the checkpoint loads
            cfg = load_config(check_run_dir(args.run) / "config.yaml", args.overrides)
        cfg.check()
        from jaxllm.tokenizer import load_tokenizer
        tok = load_tokenizer(cfg.data.tokenizer)
        if not args.hf:
            model, cfg, step = load_model(args.run, args.step, args.overrides)
    except ImportError as e:
        print(f"error: {e.name} is missing; install the serve extra: pip install "
              f"'jaxllm[serve]'", file=sys.stderr)
        return 2
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from jaxllm.inference.engine import AsyncEngine, Engine
    from jaxllm.serve.app import create_app

    name = args.served_model_name
    print(f"[model from {source}, step {step}; building the engine]", file=sys.stderr)
    try:
        engine = Engine(model, cfg, tokenizer=tok)
    except ValueError as e:  # a model or pool the engine cannot serve
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxllm.plan import describe_serving
    try:
        print(describe_serving(cfg, engine, args.hardware), file=sys.stderr)
    except ValueError as e:  # a config the planner cannot take; the engine serves it anyway
        print(f"[plan vs engine: not available: {e}]", file=sys.stderr)
    # what exists now (the model, the engine's compiled steps) lives as long as the process:
    # frozen, the garbage collector's full passes, which pause every stream, skip it
    gc.collect()
    gc.freeze()
    aeng = AsyncEngine(engine)
    aeng.start()
    try:
        app = create_app(aeng, tok, name, cfg)
        config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)  # its SIGINT / SIGTERM handlers end run()
        # uvicorn re-sends the signal once it has shut down, to the handlers it found: these
        # take it, so the engine thread is stopped below rather than the process killed
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"[serving {name!r} at http://{host}:{sock.getsockname()[1]}/v1 "
              f"(max_model_len {engine.max_model_len}); Ctrl-C stops]", file=sys.stderr)
        server.run(sockets=[sock])
    finally:
        aeng.stop()
    print("[engine stopped]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
