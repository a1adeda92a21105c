"""Chat templates render and encode as transformers' apply_chat_template does."""
import json

import pytest
import transformers
from bpe_tokenizer import small_bpe
from tokenizers import Tokenizer

from jaxllm import chat
from jaxllm.tokenizer import HFTokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
# Llama 2 / Mistral shape: a default system prompt, strict alternation, eos after replies
ALTERNATING = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}{% set rest = messages[1:] %}
{% else %}
    {% set system = 'You are helpful.' %}{% set rest = messages %}
{% endif %}
{% for message in rest %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if loop.first %}
            {% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}
        {% else %}
            {% set content = message['content'] %}
        {% endif %}
        {{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] | trim + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": " four "},
     {"role": "user", "content": "and ünïcode 日本?"}],
]


@pytest.fixture(scope="module")
def tokenizer_json():
    return small_bpe(SPECIALS).to_str()


def _write(d, tokenizer_json, template, bos, eos, as_file):
    Tokenizer.from_str(tokenizer_json).save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    if as_file:
        (d / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name, template, bos, eos, as_file", [
    ("chatml", CHATML, None, "<|im_end|>", False),
    ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
    ("alternating", ALTERNATING, "<s>", "</s>", False),
])
def test_template_matches_transformers(name, template, bos, eos, as_file, tokenizer_json,
                                       tmp_path):
    _write(tmp_path, tokenizer_json, template, bos, eos, as_file)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = HFTokenizer(tmp_path)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert chat.render(ours, messages, add_generation_prompt=gen) == text
            assert chat.encode(ours, messages, add_generation_prompt=gen) == ids
    if name == "alternating":  # the default system prompt, and the template's own error
        assert "You are helpful." in chat.render(ours, CONVERSATIONS[0])
        bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        with pytest.raises(Exception, match="must alternate"):
            ref.apply_chat_template(bad, tokenize=False)
        with pytest.raises(chat.ChatTemplateError, match="must alternate"):
            chat.render(ours, bad)


def test_no_template_is_a_clear_error(tokenizer_json, tmp_path):
    Tokenizer.from_str(tokenizer_json).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="has no chat template"):
        chat.render(HFTokenizer(tmp_path), CONVERSATIONS[0])
