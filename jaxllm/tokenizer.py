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
        """A callable that takes new ids and returns the text they complete; with
        final=True (the sequence has ended) also what it held back (an incomplete
        character, as the replacement character)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def step(ids, final: bool = False) -> str:
            if isinstance(ids, (list, tuple)):  # a sequence of ints (not a buffer)
                try:  # the common case: byte ids only
                    return dec.decode(bytes(ids), final)
                except (ValueError, TypeError):  # special ids are dropped
                    pass
            return dec.decode(bytes(int(i) for i in ids if 0 <= int(i) < 256), final)

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
        # ids of the byte-fallback pieces <0x00> .. <0xFF> (none in most BPE vocabularies)
        self.byte_piece_ids = frozenset(
            i for i in (self._tok.token_to_id(f"<0x{b:02X}>") for b in range(256))
            if i is not None)

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
        """A callable that takes new ids and returns the text they complete.

        Each call decodes a short window, not the whole sequence: the ids from `start` to the
        end, against the same window up to `shown` (the ids whose text was handed out). The
        window's first ids give the new ones their context (a SentencePiece word's leading
        space, a multi-byte character split over byte pieces); the text past the window's
        known part is what is new. While it ends in an incomplete character or adds nothing
        yet, nothing is handed out and the window grows. The window starts at the ids of the
        last piece handed out, but never inside a run of byte-fallback pieces (`<0x..>`),
        which decode as one string; where a window's text does not extend what it showed
        before, the whole sequence is decoded once. final=True (the sequence has ended)
        hands out what was held back too, so the pieces join to `decode` of every id.
        Tokenizers with transformers' clean-up rules (" ." -> ".", which can change a space
        already handed out) decode the whole sequence every call instead."""
        if self._clean_up:
            return self._whole_text_decoder()
        ids, start, shown, sent = [], 0, 0, 0  # sent: characters handed out

        def step(new_ids, final: bool = False):
            nonlocal start, shown, sent
            ids.extend(int(i) for i in new_ids)
            known = self.decode(ids[start:shown]) if shown > start else ""
            text = self.decode(ids[start:])
            if len(text) <= len(known) or (text.endswith("\ufffd") and not final):
                return ""
            if text.startswith(known):
                out = text[len(known):]
            else:  # rare: the whole text, past what was handed out
                out = self.decode(ids)[sent:]
            sent += len(out)
            if not shown or ids[shown - 1] not in self.byte_piece_ids:
                start = shown
            shown = len(ids)
            return out

        return step

    def _whole_text_decoder(self):
        """The stream decoder of tokenizers with transformers' clean-up rules: the whole
        sequence decoded each call; a last space that could still start a rule (" n" of
        " n't") is held back with what follows it, the rest handed out."""
        ids, shown = [], [""]

        def step(new_ids, final: bool = False):
            ids.extend(int(i) for i in new_ids)
            text = self.decode(ids)
            if not text.startswith(shown[0]) or (text.endswith("\ufffd") and not final):
                return ""
            cut = text.rfind(" ")
            if (not final and cut >= len(shown[0])
                    and any(a.startswith(text[cut:]) for a, _ in _CLEAN_UP)):
                text = text[:cut]
            out, shown[0] = text[len(shown[0]):], text
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
