"""HF tokenizers give transformers' ids and text: post-processors, add_bos_token /
add_eos_token, special tokens in the text, whitespace, unicode, byte fallback."""
import json

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxllm.tokenizer import HFTokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog.", "all that glitters is not gold;",
          "a stitch in time saves nine!", "fortune favours the bold, don't it?"] * 8
TEXTS = ["hello world", "the lazy fox", "  two leading spaces and trailing  ",
         "tabs\tand\nnew\n\nlines", "unicode: héllo wörld 日本 🙂", "<s>the fox</s> ran <s>",
         " don't stop , ok ?", "x"]
SPECIALS = ["<unk>", "<s>", "</s>"]


def _bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=160, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _unigram():  # SentencePiece-style: metaspace, byte fallback
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=120, special_tokens=SPECIALS, unk_token="<unk>"))
    data = json.loads(tok.to_str())  # byte pieces so that any text encodes
    data["model"]["byte_fallback"] = True
    data["model"]["vocab"] += [[f"<0x{b:02X}>", -20.0] for b in range(256)]
    return Tokenizer.from_str(json.dumps(data))


BUILT = {}


def _write(tmp_path_factory, kind, post, add_bos, add_eos):
    if kind not in BUILT:
        BUILT[kind] = (_bpe if kind == "bpe" else _unigram)().to_str()
    tok = Tokenizer.from_str(BUILT[kind])
    if post == "template":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    elif post == "bytelevel":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    d = tmp_path_factory.mktemp(f"{kind}_{post}")
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>",
              "clean_up_tokenization_spaces": kind == "unigram"}
    for key, flag in (("add_bos_token", add_bos), ("add_eos_token", add_eos)):
        if flag is not None:
            config[key] = flag
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("kind, post, add_bos, add_eos", [  # add_*: None is absent
    ("bpe", "none", None, None), ("bpe", "template", None, None),
    ("bpe", "template", False, None), ("bpe", "bytelevel", True, None),
    ("bpe", "none", True, True), ("unigram", "none", None, None),
    ("unigram", "template", None, None), ("unigram", "none", True, None),
    ("unigram", "template", False, True),
])
def test_ids_and_text_match_transformers(kind, post, add_bos, add_eos, tmp_path_factory):
    d = _write(tmp_path_factory, kind, post, add_bos, add_eos)
    ref = transformers.AutoTokenizer.from_pretrained(d)
    ours = HFTokenizer(d)
    for text in TEXTS:
        ids = ref(text).input_ids
        assert ours.encode_prompt(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    assert ours.bos_id == ref.bos_token_id and ours.eos_id == ref.eos_token_id
    # a BOS only from the post-processor: transformers ignores add_bos_token beside a
    # tokenizer.json
    assert (ref("x").input_ids[0] == ref.bos_token_id) == (post == "template")


def test_eos_ids_follow_generation_config(tmp_path):
    _bpe().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    eos = HFTokenizer(tmp_path).eos_id
    assert HFTokenizer(tmp_path).eos_ids == (eos,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert HFTokenizer(tmp_path).eos_ids == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 5]}))
    assert HFTokenizer(tmp_path).eos_ids == (eos, 5)


@pytest.mark.parametrize("kind, clean_up", [("bpe", False), ("unigram", False),
                                            ("unigram", True)])
def test_stream_decoder_pieces_join_to_the_decoded_text(kind, clean_up, tmp_path):
    """Ids fed in random chunks (valid text with multi-byte characters, and random ids of
    the vocabulary but for byte-fallback pieces, whose invalid runs decode as one string):
    the pieces handed out, with the final flush, join to `decode` of every id, and at every
    point they are a prefix of it: no piece is handed out that a later id changes (clean-up
    rules, SentencePiece spaces, split characters)."""
    import random
    BUILT.setdefault(kind, (_bpe if kind == "bpe" else _unigram)().to_str())
    Tokenizer.from_str(BUILT[kind]).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"unk_token": "<unk>", "clean_up_tokenization_spaces": clean_up}))
    tok = HFTokenizer(tmp_path)
    rng = random.Random(kind + str(clean_up))
    words = "the quick brown fox 日本 héllo wörld 🙂 don't , . ! ? 's n't ünïcödé".split()
    allowed = [i for i in range(tok.vocab_size) if i not in tok.byte_piece_ids]
    cases = [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 16))))
             for _ in range(60)]
    cases += [[rng.choice(allowed) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    for ids in cases:
        dec, pieces, at, want = tok.stream_decoder(), [], 0, tok.decode(ids)
        while at < len(ids):
            n = rng.choice([1, 1, 2, 3])
            pieces.append(dec(ids[at:at + n]))
            at += n
            assert want.startswith("".join(pieces)), ids[:at]
        pieces.append(dec([], final=True))
        assert "".join(pieces) == want, ids


def test_byte_stream_decoder_flushes_an_incomplete_character():
    from jaxllm.tokenizer import ByteTokenizer
    tok = ByteTokenizer()
    ids = list("日本".encode()) + [tok.eos_id] + list("日".encode())[:2]
    dec = tok.stream_decoder()
    pieces = [dec([i]) for i in ids]
    assert "".join(pieces) == "日本" and dec([], final=True) == "\ufffd" == tok.decode(ids)[-1]
