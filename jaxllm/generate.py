"""python -m jaxllm.generate (--run RUN_DIR | --config CONFIG | --hf HF_DIR) --prompt TEXT [options]

Loads a trained model (a run directory, a config whose train.run_dir holds checkpoints,
or a Hugging Face model directory), generates from each prompt, streams the text of a
single prompt as it is produced, and prints TTFT, TPOT and tokens/s at the end.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxllm.generate",
                                 description="Generate text from a trained jaxllm model.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory (config.yaml + checkpoints/)")
    src.add_argument("--config", help="config file; its train.run_dir holds the checkpoints")
    src.add_argument("--hf", help="Hugging Face model directory (config.json, *.safetensors, "
                                  "tokenizer.json)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--prompt", action="append", default=[],
                    help="a prompt (repeatable); \\n in it stands for a newline")
    ap.add_argument("--prompt-file", help="a file with one prompt per line (\\n: newline)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=None, help="0 turns it off")
    ap.add_argument("--top-p", type=float, default=None, help="1.0 turns it off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true",
                    help="each prompt is a user message, sent through the model's chat template")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return ap


def read_prompts(args) -> list[str]:
    prompts = [p.replace("\\n", "\n") for p in args.prompt]
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.exists():
            raise ValueError(f"--prompt-file {str(path)!r} does not exist")
        prompts += [line.rstrip("\n").replace("\\n", "\n")
                    for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    return prompts


def sampling_sources(args, cfg) -> str:
    """Each sampling value and where it came from (flag, override, generation_config.json of
    an HF directory, the config, or the default)."""
    from jaxllm import hf

    generation = hf.generation_defaults(args.hf) if args.hf else {}
    overridden = {o.split("=", 1)[0].strip() for o in args.overrides}
    parts = []
    for name in ("temperature", "top_k", "top_p", "max_new_tokens"):
        source = ("--" + name.replace("_", "-") if getattr(args, name) is not None else
                  "override" if f"inference.{name}" in overridden else
                  "generation_config.json" if name in generation else
                  "default" if args.hf else "config")
        parts.append(f"{name}={getattr(cfg.inference, name)} ({source})")
    return ", ".join(parts)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from absl import logging as absl_logging  # orbax notes read-only restores at WARNING
    absl_logging.set_verbosity(absl_logging.ERROR)
    from jaxllm.config import ConfigError, load_config
    from jaxllm.inference.generate import check_prompts, generate
    from jaxllm.checkpoint import check_run_dir, load_model

    try:
        prompts = read_prompts(args)
        if args.hf:
            from jaxllm import hf
            (model, cfg), run_dir, step = hf.load(args.hf, args.overrides), args.hf, "-"
        else:  # the stored config first: every input is checked before the checkpoint loads
            run_dir = args.run or load_config(args.config, args.overrides).train.run_dir
            cfg = load_config(check_run_dir(run_dir) / "config.yaml", args.overrides)
        if args.config:  # the given config wins for inference options
            cfg = cfg.replace(inference=load_config(args.config, args.overrides).inference)
        for name in ("temperature", "top_k", "top_p", "max_new_tokens"):
            if getattr(args, name) is not None:
                from dataclasses import replace
                cfg = cfg.replace(inference=replace(cfg.inference, **{name: getattr(args, name)}))
        cfg.check()  # across sections (each replaced section checked its own values)
        from jaxllm.tokenizer import load_tokenizer
        tok = load_tokenizer(cfg.data.tokenizer)
        if args.chat:  # one user turn per prompt, through the checkpoint's template
            from jaxllm import chat
            inputs = [chat.encode(tok, [{"role": "user", "content": p}]) for p in prompts]
        else:
            inputs = [tok.encode_prompt(p) for p in prompts]
        check_prompts(inputs, cfg.inference.max_new_tokens, cfg.model.max_seq_len)
        if not args.hf:
            model, _, step = load_model(run_dir, args.step, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(f"[model from {run_dir}, step {step}]", file=sys.stderr)
    print(f"[sampling: {sampling_sources(args, cfg)}]", file=sys.stderr)
    single = len(prompts) == 1
    if single:  # a chat reply is printed without the prompt
        print("" if args.chat else prompts[0], end="", flush=True)
    result = generate(model, cfg, inputs, tokenizer=tok, seed=args.seed, return_result=True,
                      stream=(lambda s: print(s, end="", flush=True)) if single else None)
    if single:
        print()
    else:
        for p, t in zip(prompts, result.texts):
            print(f"--- {p!r}\n{'' if args.chat else p}{t}")
    print(f"[TTFT {1e3 * result.ttft_s:.1f} ms, TPOT {1e3 * result.tpot_s:.2f} ms, "
          f"{result.tokens_per_s:,.0f} tokens/s over {len(prompts)} prompt(s), "
          f"compile {result.compile_s:.1f} s]", file=sys.stderr)
    if "mean_acceptance_length" in result.stats:  # inference.speculative.method != none
        s = result.stats
        rates = " ".join(f"{r:.2f}" for r in s["acceptance_rate_per_position"])
        print(f"[speculative: {s['mean_acceptance_length']:.2f} tokens per target step, "
              f"acceptance rate {100 * s['acceptance_rate']:.1f}% (by draft position: "
              f"{rates}), {s['decode_steps']} target steps]", file=sys.stderr)
    return 0


class _CallableModule(types.ModuleType):
    """`jaxllm.generate(model, cfg, prompts)` calls `jaxllm.inference.generate.generate`:
    importing this CLI module binds it as `jaxllm.generate`, so the module is the call."""

    def __call__(self, *args, **kwargs):
        from jaxllm.inference.generate import generate
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
