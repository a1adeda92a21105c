"""Tokenizers: bytes by default (no files, no download); Hugging Face `tokenizer.json` too.

Both expose `encode(text) -> list[int]` (the text alone: training documents),
`encode_prompt(text)` (what the model is fed for a prompt: with an HF tokenizer the ids
transformers gives), `decode(ids) -> str`, `vocab_size`, `eos_id`, `eos_ids` (the ids that
end a generation), `bos_id` (None when absent) and `stream_decoder()` for printing text as
tokens arrive.
"""
from __future__ import annotations

import codecs
from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is BOS and 257 is EOS."""

    name = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode_prompt(self, text: str) -> list[int]:
        """Training documents follow an EOS, so a prompt starts a document the same way."""
        return [self.eos_id] + self.encode(text)

    def encode_bytes(self, data: bytes):
        import numpy as np
        return np.frombuffer(data, np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def stream_decoder(self):
        """A callable that takes new ids and returns the text they complete."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def step(ids) -> str:
            if isinstance(ids, (list, tuple)):  # a sequence of ints (not a buffer)
                try:  # the common case: byte ids only
                    return dec.decode(bytes(ids))
                except (ValueError, TypeError):  # special ids are dropped
                    pass
            return dec.decode(bytes(int(i) for i in ids if 0 <= int(i) < 256))

        return step


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library, giving transformers' ids.

    `encode_prompt(text)` equals `AutoTokenizer(...)(text).input_ids`: the tokenizer.json
    post-processor adds the special tokens, and nothing else does (transformers ignores
    tokenizer_config.json's `add_bos_token` / `add_eos_token` when a tokenizer.json is
    there; without a post-processor no BOS is added). `decode` is transformers'
    `decode(ids, skip_special_tokens=True)`. BOS/EOS are the tokens given, else those of
    tokenizer_config.json, else the ids of config.json. `eos_ids` are the ids that end a
    generation, as transformers' `generate` reads them: generation_config.json's
    eos_token_id (one or a list), else config.json's, else EOS.
    """

    def __init__(self, path: str | Path, bos_token: str | None = None,
                 eos_token: str | None = None):
        from tokenizers import AddedToken, Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist")
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        folder = path.parent
        self.config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        named = {k: _content(self.config.get(k)) for k in SPECIAL_KEYS}
        named["bos_token"] = bos_token or named["bos_token"]
        named["eos_token"] = eos_token or named["eos_token"]
        self.special_tokens = {k: t for k, t in named.items() if t}  # name -> text
        # transformers registers every named special token as a special added token
        extra = (self.config.get("additional_special_tokens")
                 or self.config.get("extra_special_tokens") or [])  # the transformers 5 key
        extra = [_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        have = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t in [*named.values(), *extra]
                                      if t and t not in have])
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.eos_id = (
            self._tok.token_to_id(named[k]) if named[k] else _first(model_config.get(k + "_id"))
            for k in ("bos_token", "eos_token"))
        generation = _read_json(folder / "generation_config.json")
        eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = tuple(eos) if eos else (() if self.eos_id is None else (self.eos_id,))
        self._clean_up = (bool(self.config.get("clean_up_tokenization_spaces", False))
                          and type(self._tok.model).__name__ != "BPE")  # as transformers

    def encode(self, text: str) -> list[int]:
        """The text's ids alone (no special tokens added): training documents."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids transformers feeds the model for `text` (special tokens added)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for a, b in _CLEAN_UP:
                text = text.replace(a, b)
        return text

    def stream_decoder(self):
        """Decode the growing sequence and return what was added (handles merged pieces)."""
        ids, shown = [], [""]

        def step(new_ids):
            ids.extend(int(i) for i in new_ids)
            text = self.decode(ids)
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait
                return ""
            out = text[len(shown[0]):] if text.startswith(shown[0]) else text
            shown[0] = text
            return out

        return step


SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                "mask_token")
# transformers' clean_up_tokenization (applied to non-BPE models that ask for it)
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
             (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _read_json(path: Path) -> dict:
    import json
    return json.loads(path.read_text()) if path.exists() else {}


def _content(token):
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _first(v):
    v = v[0] if isinstance(v, list) and v else v
    return v if isinstance(v, int) else None


def load_tokenizer(spec: str = "byte"):
    """"byte" or a path to a tokenizer.json (or a directory holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
