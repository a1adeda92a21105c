"""Tokenizers: bytes by default (no files, no download); Hugging Face `tokenizer.json` too.

Both expose `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `eos_id`,
`bos_id` (None when absent) and `stream_decoder()` for printing text as tokens arrive.
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
    def prompt_prefix(self) -> list[int]:
        """Training documents follow an EOS, so a prompt starts a document the same way."""
        return [self.eos_id]

    def encode_bytes(self, data: bytes):
        import numpy as np
        return np.frombuffer(data, np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def stream_decoder(self):
        """A callable that takes new ids and returns the text they complete."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: dec.decode(bytes(int(i) for i in ids if 0 <= int(i) < 256))


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library.

    BOS/EOS are the tokens given, else those of a `tokenizer_config.json` beside the file,
    else the ids of a model `config.json` beside it (bos_token_id, eos_token_id).
    """

    def __init__(self, path: str | Path, bos_token: str | None = None,
                 eos_token: str | None = None):
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist")
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.eos_id = _special_ids(self._tok, path.parent)
        if bos_token:
            self.bos_id = self._tok.token_to_id(bos_token)
        if eos_token:
            self.eos_id = self._tok.token_to_id(eos_token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    @property
    def prompt_prefix(self) -> list[int]:
        return [] if self.bos_id is None else [self.bos_id]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

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


def _special_ids(tok, folder: Path) -> tuple[int | None, int | None]:
    """(bos, eos) ids from HF's tokenizer_config.json, else config.json, in `folder`."""
    import json

    if (folder / "tokenizer_config.json").exists():
        c = json.loads((folder / "tokenizer_config.json").read_text())
        ids = []
        for key in ("bos_token", "eos_token"):
            token = c.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            ids.append(tok.token_to_id(token) if token else None)
        if c.get("add_bos_token") is False:  # the model is not fed a BOS
            ids[0] = None
        return ids[0], ids[1]
    if (folder / "config.json").exists():
        c = json.loads((folder / "config.json").read_text())
        first = [v[0] if isinstance(v, list) and v else v
                 for v in (c.get("bos_token_id"), c.get("eos_token_id"))]
        return tuple(v if isinstance(v, int) else None for v in first)
    return None, None


def load_tokenizer(spec: str = "byte"):
    """"byte" or a path to a tokenizer.json (or a directory holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
