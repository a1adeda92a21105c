"""Chat templates: a checkpoint's Jinja template rendered as transformers renders it.

    ids = jaxllm.chat.encode(tokenizer, [{"role": "user", "content": "hi"}])
    text = jaxllm.chat(model, cfg, [{"role": "user", "content": "hi"}])

The template is `chat_template.jinja` beside the tokenizer, else `chat_template` of
tokenizer_config.json (a string, or a list of named templates: "default" is taken). It
sees `messages`, `add_generation_prompt`, the named special tokens (`bos_token`,
`eos_token`, ...), `raise_exception(message)`, `strftime_now(format)` and a `tojson` that
keeps non-ASCII text; it runs in jinja2's immutable sandbox, since templates come with
downloaded checkpoints. The rendered text is encoded without added special tokens (the
template writes them), as `apply_chat_template(..., tokenize=True)` does.
"""
from __future__ import annotations

import functools
import json
import sys
import types
from datetime import datetime
from pathlib import Path


class ChatTemplateError(ValueError):
    """A template raised (`raise_exception`) or could not be rendered."""


def template_of(tokenizer) -> str:
    """The chat template of an HF tokenizer (ValueError when it has none)."""
    if not hasattr(tokenizer, "special_tokens"):  # the byte tokenizer
        raise ValueError(f"the {getattr(tokenizer, 'name', '?')!r} tokenizer has no chat "
                         f"template; chat needs a Hugging Face tokenizer (data.tokenizer)")
    folder = Path(tokenizer.name).parent
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    template = tokenizer.config.get("chat_template")
    if isinstance(template, list):  # named templates
        template = {t["name"]: t["template"] for t in template}.get("default")
    if not template:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no chat "
                         f"template (no chat_template.jinja, no chat_template in "
                         f"tokenizer_config.json); give prompts as text instead")
    return template


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext  # loopcontrols; `import jinja2` alone does not load the module
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
           template: str | None = None, **variables) -> str:
    """The template's text for `messages` (a list of {"role", "content"} dicts).
    `variables` reach the template too (e.g. enable_thinking=False)."""
    import jinja2

    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict)
                                                          for m in messages):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts; "
                         f"got {messages!r}")
    compiled = _compile(template or template_of(tokenizer))
    context = {**(getattr(tokenizer, "special_tokens", None) or {}), **variables}
    try:
        return compiled.render(messages=[dict(m) for m in messages], tools=None,
                               documents=None, add_generation_prompt=add_generation_prompt,
                               **context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from e


def encode(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
           template: str | None = None, **variables) -> list[int]:
    """The ids of the rendered conversation (no special tokens added beyond the template's)."""
    return tokenizer.encode(render(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   template=template, **variables))


def chat(model, cfg, messages, *, tokenizer=None, add_generation_prompt: bool = True,
         template: str | None = None, **options):
    """The model's reply to one conversation (or a list of them: a list of replies).
    `options` are those of `jaxllm.generate` (max_new_tokens, temperature, ...)."""
    from jaxllm.inference.generate import generate
    from jaxllm.tokenizer import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer)
    single = bool(messages) and isinstance(messages[0], dict)
    conversations = [messages] if single else list(messages)
    ids = [encode(tokenizer, c, add_generation_prompt=add_generation_prompt, template=template)
           for c in conversations]
    out = generate(model, cfg, ids, tokenizer=tokenizer, **options)
    return out[0] if single and isinstance(out, list) else out


class _CallableModule(types.ModuleType):
    """`jaxllm.chat(model, cfg, messages)` calls `chat` while `jaxllm.chat.render` etc. stay
    reachable: importing this module binds it as `jaxllm.chat`, so the module is the call."""

    def __call__(self, *args, **kwargs):
        return chat(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
