"""The OpenAI-compatible server, driven by the real `openai` client over HTTP: replies match
the model's greedy output, streams join to the same text, bad fields are 400s naming them,
a full queue is a 429, and a client that goes away mid-stream gets its request aborted
(its KV pages freed)."""
import http.client
import json
import socket
import threading
import time

import openai
import pytest
import uvicorn
from bpe_tokenizer import small_bpe
from flax import nnx

import jaxllm
from jaxllm import chat
from jaxllm.config import load_config
from jaxllm.inference.engine import AsyncEngine, Engine
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.model import build_model
from jaxllm.serve import __main__ as serve_cli
from jaxllm.serve import app as serve_app
from jaxllm.serve import create_app
from jaxllm.serve.metrics import COUNTERS, GAUGES
from jaxllm.tokenizer import ByteTokenizer, HFTokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MAX_LEN = 256
NAME = "tiny"
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = small_bpe(SPECIALS)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "chat_template": CHATML}))
    return HFTokenizer(d)


@pytest.fixture(scope="module")
def model_cfg(tokenizer):
    cfg = load_config(None, [
        f"model.vocab_size={tokenizer.vocab_size}", "model.d_model=64", "model.n_layers=2",
        "model.n_heads=2", "model.n_kv_heads=1", "model.mlp_dim=128",
        f"model.max_seq_len={MAX_LEN}", "model.init_std=0.3",
        f"data.tokenizer={tokenizer.name}"])
    return build_model(cfg.model, rngs=nnx.Rngs(5)), cfg


ENGINE = dict(page_size=16, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64)


class Served:
    """uvicorn serving `app` on a free port of 127.0.0.1, in a background thread."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.01)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                                    timeout=TIMEOUT, max_retries=0)

    def get(self, path):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read().decode()
        finally:
            conn.close()

    def stop(self):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(model_cfg, tokenizer):
    model, cfg = model_cfg
    aeng = AsyncEngine(Engine(model, cfg, tokenizer=tokenizer, **ENGINE))
    aeng.start()
    s = Served(create_app(aeng, tokenizer, NAME, cfg))
    s.aeng = aeng
    yield s
    s.stop()
    aeng.stop()


@pytest.fixture(scope="module")
def params(model_cfg):
    model, cfg = model_cfg
    return decode_params(model, cfg)


def _greedy_ids(params, ids, n):
    """The model's greedy continuation of `ids`, EOS ignored."""
    out, _ = generate_ids(params, [ids], max_new_tokens=n, temperature=0.0, warmup=False)
    return out[0]


def _idle(engine, timeout=TIMEOUT):
    """Wait (bounded) until the engine runs nothing and holds no pages."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["pages_used"] == 0:
            return s
        assert time.monotonic() < deadline, f"the engine did not drain: {s}"
        time.sleep(0.02)


PROMPT = "hello there, you are"


def test_completion_greedy_matches_the_model(served, tokenizer, params):
    ids = tokenizer.encode_prompt(PROMPT)
    want = tokenizer.decode(_greedy_ids(params, ids, 12))
    r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == NAME
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(ids), 12, len(ids) + 12)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0

    # a seeded sampled request is reproducible (whatever else runs beside it)
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    assert served.client.completions.create(**kw).choices[0].text == \
        served.client.completions.create(**kw).choices[0].text

    # a stop string cuts the text before it
    stop = want[5:7]
    r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                         temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[:want.index(stop)]
    assert r.choices[0].finish_reason == "stop"

    # the same prompt as ids, and a list of prompts: one choice each, in order
    other = tokenizer.encode_prompt("answer briefly")
    r2 = served.client.completions.create(model=NAME, prompt=[ids, other], max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.choices[0].text == want
    assert r2.choices[1].text == tokenizer.decode(_greedy_ids(params, other, 12))
    assert r2.usage.prompt_tokens == len(ids) + len(other)
    assert r2.usage.completion_tokens == 24


def test_streamed_completion_joins_to_the_reply(served):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**kw)
    chunks = list(served.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # it streamed
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1

    # return_token_ids: every step's tokens arrive, joining to the reply's ids
    kw_ids = dict(kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = served.client.completions.create(**kw_ids).choices[0].token_ids
    streamed = [t for c in served.client.completions.create(**kw_ids, stream=True)
                for t in c.choices[0].token_ids]
    assert len(ids) == 20 and streamed == ids

    # two prompts in one stream: each choice's chunks join to its own reply
    kw["prompt"] = [PROMPT, "answer briefly"]
    whole = served.client.completions.create(**kw)
    texts = ["", ""]
    for c in served.client.completions.create(**kw, stream=True):
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in whole.choices]


def test_chat_reply_and_stream(served, model_cfg, tokenizer):
    model, cfg = model_cfg
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "hello there"}]
    ids = chat.encode(tokenizer, messages)
    want = jaxllm.generate(model, cfg, [ids], max_new_tokens=10, temperature=0.0,
                           tokenizer=tokenizer)[0]
    r = served.client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                              max_completion_tokens=10)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(ids)

    chunks = list(served.client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, max_tokens=10, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == \
        r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    # no max tokens given: the reply may fill the context
    r = served.client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == MAX_LEN


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(temperature="hot"), "temperature"),  # a wrong type: 400, not FastAPI's 422
    (dict(max_tokens=MAX_LEN), "max_tokens"),  # prompt + max_tokens past the context
    (dict(n=2), "n"),
    (dict(logprobs=2), "logprobs"),
    (dict(echo=True), "echo"),
    (dict(extra_body={"top_k": -3}), "top_k"),
    (dict(prompt=[]), "prompt"),
])
def test_bad_request_names_the_field(served, kw, param):
    kw = {"model": NAME, "prompt": PROMPT, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(**kw)
    err = e.value.body
    assert e.value.status_code == 400
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param in err["message"]


def test_bad_chat_requests(served):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model=NAME, messages=messages,
                                              max_completion_tokens=MAX_LEN)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model=NAME, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        served.client.chat.completions.create(model="other", messages=messages)
    assert e.value.body["param"] == "model"


def test_models_health_metrics(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert served.get("/health")[0] == 200
    served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
    status, text = served.get("/metrics")
    assert status == 200
    names = [n for n, _ in GAUGES.values()] + [n + "_total" for n, _ in COUNTERS.values()] + [
        "jaxllm_prefix_cache_hit_rate", "jaxllm_time_to_first_token_seconds_bucket",
        "jaxllm_time_per_output_token_seconds_bucket", "jaxllm_e2e_request_latency_seconds_count"]
    for name in names:
        assert f"\n{name}" in text, name
    e2e = [l for l in text.splitlines() if l.startswith("jaxllm_e2e_request_latency_seconds_count")]
    assert float(e2e[0].split()[-1]) >= 1
    gen = [l for l in text.splitlines() if l.startswith("jaxllm_generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 4


def _long_completion(served, n: int, stream: bool) -> http.client.HTTPConnection:
    """A raw connection that has sent a greedy completion request of n tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": NAME, "prompt": PROMPT, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "stream": stream}), headers={"Content-Type": "application/json"})
    return conn


def test_client_disconnect_aborts_the_stream(served):
    engine = served.aeng.engine
    before = _idle(engine)
    n = MAX_LEN - 16
    conn = _long_completion(served, n, stream=True)
    r = conn.getresponse()
    assert r.status == 200
    got = 0
    while got < 2:  # the first chunks arrive
        line = r.readline()
        assert line, "the stream ended early"
        got += line.startswith(b"data: {")
    assert engine.stats()["running"] + engine.stats()["waiting"] >= 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after = _idle(engine)
    assert after["generation_tokens"] - before["generation_tokens"] < n  # cut short


def test_client_disconnect_aborts_a_plain_request(served, monkeypatch):
    monkeypatch.setattr(serve_app, "DISCONNECT_POLL_S", 0.01)
    engine = served.aeng.engine
    before = _idle(engine)
    n = MAX_LEN - 16
    conn = _long_completion(served, n, stream=False)
    deadline = time.monotonic() + TIMEOUT
    while engine.stats()["running"] == 0:  # it started
        assert time.monotonic() < deadline
        time.sleep(0.001)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after = _idle(engine)
    assert after["generation_tokens"] - before["generation_tokens"] < n


def test_full_queue_is_429_and_no_template_is_400(model_cfg, tokenizer):
    """An engine that queues one request at most and never takes its queue in (its thread
    runs, but hands nothing to the engine): the first request waits, the next is refused.
    A tokenizer without a chat template cannot serve chat."""
    model, cfg = model_cfg
    # the same step shapes as the module's engine: its compiled steps are reused
    aeng = AsyncEngine(Engine(model, cfg, tokenizer=tokenizer, **{**ENGINE, "max_waiting": 1}))
    aeng._apply_commands = lambda: None  # added requests stay queued
    aeng.start()
    s = Served(create_app(aeng, ByteTokenizer(), NAME, cfg))
    try:
        with pytest.raises(openai.BadRequestError) as e:
            s.client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                    "content": "hi"}])
        assert e.value.body["param"] == "messages" and "template" in e.value.body["message"]

        outcome = []

        def queued():  # held in the queue until its client gives up (or refused, if the
            try:       # loop below got its request in first)
                s.client.with_options(timeout=3.0).completions.create(
                    model=NAME, prompt=[1, 2, 3], max_tokens=2)
            except (openai.APITimeoutError, openai.RateLimitError) as e:
                outcome.append(type(e))

        first = threading.Thread(target=queued, daemon=True)
        first.start()
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:  # refused at once once the first request is queued
                s.client.with_options(timeout=2.0).completions.create(
                    model=NAME, prompt=[4, 5], max_tokens=2)
            except openai.RateLimitError as e:
                assert e.status_code == 429 and e.body["code"] == "queue_full"
                break
            except openai.APITimeoutError:  # it was queued before the first one
                pass
            assert time.monotonic() < deadline
        first.join(TIMEOUT)
        assert len(outcome) == 1
    finally:
        s.stop()
        aeng.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_is_503(model_cfg, tokenizer):
    model, cfg = model_cfg
    aeng = AsyncEngine(Engine(model, cfg, tokenizer=tokenizer, **ENGINE))

    def broken():
        raise RuntimeError("a failing step")

    aeng.engine.step = broken
    aeng.start()
    s = Served(create_app(aeng, tokenizer, NAME, cfg))
    try:
        with pytest.raises(openai.InternalServerError) as e:  # the request that killed it
            s.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 503 and "a failing step" in e.value.body["message"]
        assert s.get("/health")[0] == 503
        with pytest.raises(openai.InternalServerError) as e:  # refused at once
            s.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 503
    finally:
        s.stop()
        aeng.stop()


def test_cli_refuses_a_missing_run(tmp_path, capsys):
    assert serve_cli.main(["--run", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert serve_cli.main(["--hf", str(tmp_path), "--port", "70000"]) == 2
    capsys.readouterr()
    assert serve_cli.main(["--hf", str(tmp_path), "--hardware", "tpu9"]) == 2  # before loading
    assert "hardware='tpu9' is unknown" in capsys.readouterr().err
    with socket.socket() as busy:  # a port in use: refused before anything loads
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        capsys.readouterr()
        assert serve_cli.main(["--hf", str(tmp_path), "--port", str(port)]) == 2
        assert "cannot listen" in capsys.readouterr().err
