"""A small byte-level BPE tokenizer trained in the test, shared by the chat and server tests."""
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def small_bpe(special_tokens: list[str]) -> Tokenizer:
    """A 300-entry byte-level BPE with `special_tokens`, trained on a few English words."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello there, answer briefly. you are helpful and four"] * 4,
                            trainer)
    return tok
