"""`mlxspec serve` end to end: a real server process on a free port, driven by the official
`openai` client (and httpx for what the client hides), against a tiny random pair saved to disk.

The pair's target has its end-of-sequence logit scaled down, so some prompts end early with
"stop" and others run to max_tokens: long generations for the disconnect and concurrency tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import openai
import pytest

import mlxspec
from mlxspec.options import GenerateOptions
from mlxspec.server.prompt_cache import PromptCache
from mlxspec.server.schema import ApiError, Served, prepare
from mlxspec.server.stops import StopScanner
from mlxspec.server.text import TextStream

from conftest import perturbed, save_tiny, tiny_llama

KEY = "test-key-123"
CONTEXT = 2048
SHORT = "w46 w49 w52 w55"  # ends with the end-of-sequence token after a few tokens (checked below)
PROMPTS = [" ".join(f"w{6 + (i * 7 + j * 3) % 58}" for j in range(4)) for i in range(30)]


# -- fixtures: one pair folder, one server process per module ---------------------------------


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    target = tiny_llama(1)
    w = target.lm_head.weight  # eos (id 2) logit halved: some prompts stop early, most run long
    target.lm_head.weight = mx.concatenate([w[:2], w[2:3] * 0.5, w[3:]])
    mx.eval(target.parameters())
    root = tmp_path_factory.mktemp("serve-pair")
    save_tiny(root / "target", target)
    save_tiny(root / "draft", perturbed(target, seed=3, noise=0.05))
    for sub in ("target", "draft"):
        cfg = json.loads((root / sub / "config.json").read_text())
        cfg["max_position_embeddings"] = CONTEXT
        (root / sub / "config.json").write_text(json.dumps(cfg))
    (root / "mlxspec-pair.json").write_text(
        json.dumps({"format": "mlxspec-pair", "version": 1, "target": "target", "draft": "draft"}))
    return root


@pytest.fixture(scope="module")
def pair(pair_dir):
    return mlxspec.load(pair_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(pair_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    cmd = [sys.executable, "-m", "mlxspec.cli", "serve", "-t", str(pair_dir), "--port", str(port),
           "--model-name", "pair", "--prompt-cache-size", "4", "--queue-size", "32", "--max-body-mb", "1", "--log-level", "warning"]
    env = {**os.environ, "MLXSPEC_API_KEY": KEY}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail(f"the server did not start: {log.read_text()}")
    yield url
    proc.terminate()  # uvicorn shuts down gracefully, then re-raises SIGTERM
    try:
        assert proc.wait(timeout=20) in (0, -15), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def metric(server, name: str) -> float:
    with http(server) as c:
        text = c.get("/metrics").text
    return float(re.search(rf"^mlxspec_{name} (\S+)$", text, re.M).group(1))


def text_of(pair, result) -> str:
    """What the API answers: the decode of the generated tokens."""
    return pair.tokenizer.decode(result.tokens)


def check_timings(t: dict, completion_tokens: int, drafter: str) -> None:
    assert t["predicted_n"] == completion_tokens
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["drafter"] == drafter and t["passes"] >= 1
    assert t["tokens_per_pass"] == pytest.approx(1 + t["draft_n_accepted"] / t["passes"])
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0


# -- the API against the engine ---------------------------------------------------------------


def test_short_prompt_stops_and_long_prompts_run(pair):
    # the fixture's premise: SHORT ends with eos, PROMPTS[0] does not within 100 tokens
    assert pair.generate(SHORT, max_tokens=100).stats.finish_reason == "stop"
    assert pair.generate(PROMPTS[0], max_tokens=100).stats.finish_reason == "length"


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_greedy_completion_equals_generate(client, pair, drafter):
    for prompt, n in [(SHORT, 64), (PROMPTS[0], 48)]:
        want = pair.generate(prompt, max_tokens=n, drafter=drafter)
        r = client.completions.create(model="pair", prompt=prompt, max_tokens=n, extra_body={"drafter": drafter})
        assert r.choices[0].text == text_of(pair, want) and want.tokens
        assert r.choices[0].finish_reason == want.stats.finish_reason
        assert r.usage.prompt_tokens == len(pair.encode(prompt))
        assert r.usage.completion_tokens == len(want.tokens)
        check_timings(r.timings, len(want.tokens), drafter)
        if drafter == "model":
            assert r.timings["draft_n"] > 0


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_greedy_chat_equals_generate(client, pair, drafter):
    msgs = [{"role": "system", "content": "w7"}, {"role": "user", "content": PROMPTS[1]}]
    want = pair.generate(msgs, max_tokens=40, drafter=drafter)
    r = client.chat.completions.create(model="pair", messages=msgs, max_completion_tokens=40,
                                       extra_body={"drafter": drafter})
    assert r.choices[0].message.content == text_of(pair, want) and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(pair.encode(msgs))
    check_timings(r.timings, len(want.tokens), drafter)


def test_streaming_equals_non_streaming(client, pair, server):
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    whole = client.chat.completions.create(model="pair", messages=msgs, max_tokens=40)
    chunks = list(client.chat.completions.create(model="pair", messages=msgs, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    check_timings(finals[0].timings, 40, "model")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    # completions stream the same text as generate; the raw stream ends with [DONE]
    want = text_of(pair, pair.generate(PROMPTS[3], max_tokens=30))
    body = {"prompt": PROMPTS[3], "max_tokens": 30, "stream": True}
    with http(server) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    docs = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(d["choices"][0]["text"] for d in docs) == want
    assert "timings" in docs[-1] and "usage" not in docs[-1]  # no usage chunk unless asked


def test_stop_string_split_across_rounds(client, pair):
    prompt = PROMPTS[4]
    detok = TextStream(pair.tokenizer)  # the server's text, one piece per round
    pieces = [detok.add(c.tokens) for c in pair.stream(prompt, max_tokens=60)]
    full = "".join(pieces)
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3)
    stop = pieces[i][-2:] + pieces[i + 1][:2]  # the end of one round and the start of the next
    want = full[: full.find(stop)]
    r = client.completions.create(model="pair", prompt=prompt, max_tokens=60, stop=[stop, "never-seen"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    sent = [c.choices[0].text for c in client.completions.create(
        model="pair", prompt=prompt, max_tokens=60, stop=stop, stream=True)]
    assert "".join(sent) == want  # nothing past the stop string went out, even in pieces


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model="pair", prompt=PROMPTS[5], max_tokens=24, temperature=1.0,
                                         seed=seed, extra_body={"top_k": 20}).choices[0].text
    assert sample(11) == sample(11)
    assert len({sample(s) for s in range(1, 5)}) > 1


def test_sixteen_concurrent_clients_get_their_own_output(client, pair):
    jobs = [(PROMPTS[10 + i], ["model", "lookup", "none"][i % 3], 20 + i) for i in range(16)]
    want = [text_of(pair, pair.generate(p, max_tokens=n, drafter=d)) for p, d, n in jobs]

    def one(job):
        p, d, n = job
        r = client.completions.create(model="pair", prompt=p, max_tokens=n, extra_body={"drafter": d})
        return r.choices[0].text

    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, jobs))
    assert got == want


def test_disconnect_stops_generation_and_the_server_stays_responsive(server, client, pair):
    before = metric(server, "requests_cancelled_total"), metric(server, "generation_tokens_total")
    body = {"prompt": PROMPTS[6], "max_tokens": 2000, "stream": True}
    with http(server) as c, c.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen == 3:
                break
        tic = time.perf_counter()  # the generation runs on: the event loop still answers
        assert httpx.get(server + "/health").status_code == 200
        assert c.get("/v1/models").json()["data"][0]["id"] == "pair"
        assert time.perf_counter() - tic < 2.0
    deadline = time.time() + 20
    while metric(server, "requests_cancelled_total") == before[0] or metric(server, "busy"):
        assert time.time() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert metric(server, "generation_tokens_total") - before[1] < 2000
    r = client.completions.create(model="pair", prompt=SHORT, max_tokens=64)
    assert r.choices[0].text == text_of(pair, pair.generate(SHORT, max_tokens=64))


def test_second_turn_prefills_only_the_new_message(client, pair):
    msgs = [{"role": "user", "content": PROMPTS[7]}]
    first = client.chat.completions.create(model="pair", messages=msgs, max_tokens=16)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "w9 w10"}]
    second = client.chat.completions.create(model="pair", messages=msgs, max_tokens=16)
    ids1, ids2 = pair.encode(msgs[:1]), pair.encode(msgs)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the KV cache holds the first prompt and the reply but its last token (never fed back)
    assert len(ids1) + 16 - 1 <= cached < len(ids2) == second.usage.prompt_tokens
    assert second.timings["cache_n"] == cached and second.timings["prompt_n"] == len(ids2) - cached
    want = text_of(pair, pair.generate(msgs, max_tokens=16))
    assert second.choices[0].message.content == want
    fresh = client.chat.completions.create(model="pair", messages=msgs, max_tokens=16,
                                           extra_body={"cache_prompt": False})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0 and fresh.choices[0].message.content == want


def test_metrics_count_requests(server):
    assert httpx.get(server + "/metrics").status_code == 401
    assert metric(server, "requests_total") >= 1 and metric(server, "draft_tokens_accepted_total") >= 0
    assert metric(server, "draft_tokens_accepted_total") <= metric(server, "draft_tokens_total")
    assert 1 <= metric(server, "prompt_cache_sessions") <= 4 and metric(server, "prompt_cache_bytes") > 0


# -- bad requests: a 4xx with OpenAI's error object, and the server keeps serving --------------


def test_api_key(server):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server + "/v1/completions", json={"prompt": SHORT})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()


CHAT = {"model": "pair", "messages": [{"role": "user", "content": "w10"}], "max_tokens": 4}
BAD = [
    # (path, body (dict, or raw bytes), status, param or code)
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {**CHAT, "messages": 5}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "pair"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model_not_found"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1.0}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "seed": -1}, 400, "seed"),
    ("/v1/chat/completions", {**CHAT, "drafter": "psychic"}, 400, "drafter"),
    ("/v1/chat/completions", {**CHAT, "num_draft": -1}, 400, "num_draft"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("/v1/completions", {"prompt": " ".join(["w9"] * (CONTEXT + 10))}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5, 9, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["w9", "w10"]}, 400, "prompt"),
    ("/v1/completions", b'{"prompt": "' + b"w9 " * 400_000 + b'"}', 413, "body_too_large"),
    ("/v1/embeddings", {"input": "w9"}, 404, "not_found"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client, pair):
    with http(server) as c:
        check_bad_requests(c)
        r = c.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = client.completions.create(model="pair", prompt=SHORT, max_tokens=64)
    assert r.choices[0].text == text_of(pair, pair.generate(SHORT, max_tokens=64))


def check_bad_requests(c: httpx.Client) -> None:
    for path, body, status, where in BAD:
        r = c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
        assert r.status_code == status, (path, body if isinstance(body, dict) else body[:40], r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] and where in (err["param"], err["code"]), (where, err)
        assert "Traceback" not in r.text


def test_max_tokens_past_the_context_window_is_lowered_with_a_warning(server):
    prompt = " ".join(["w9"] * (CONTEXT - 5))
    with http(server) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 100})
    assert r.status_code == 200 and "max_tokens lowered to 5" in r.headers["x-mlxspec-warning"]
    assert r.json()["usage"]["completion_tokens"] <= 5


# -- in-process: request parsing, the queue, the prompt cache, stop strings -------------------


def test_model_drafter_without_a_draft_model_is_ignored_with_a_warning(pair_dir):
    alone = mlxspec.load(pair_dir / "target")
    served = Served(alone, "t", GenerateOptions(drafter="lookup"), CONTEXT)
    p = prepare("completion", {"prompt": SHORT, "drafter": "model"}, served)
    assert p.options.drafter == "lookup" and "needs a draft model" in p.warnings[0]
    with pytest.raises(ApiError) as e:
        prepare("completion", {"prompt": SHORT, "model": "other"}, served)
    assert e.value.status == 404


def test_full_queue_answers_429_with_retry_after(pair):
    from mlxspec.server.app import create_app
    from mlxspec.server.worker import Job, Worker

    served = Served(pair, "pair", GenerateOptions(), CONTEXT)
    worker = Worker(pair, prompt_cache_size=1, queue_size=2)  # its thread is never started here
    app = create_app(served, worker)

    async def go():
        loop = asyncio.get_running_loop()
        for _ in range(2):
            worker.submit(Job(prepare("completion", {"prompt": SHORT}, served), loop))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": SHORT})
            health = await c.get("/health")
        return r, health

    r, health = asyncio.run(go())
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full" and health.status_code == 200
    assert worker.metrics.requests_rejected == 1


def test_prompt_cache_reuses_extensions_and_keeps_other_conversations(pair):
    cache = PromptCache(pair, size=2)
    opts = GenerateOptions(max_tokens=8)
    key = ("model", 1, 4)

    def turn(ids):
        s = cache.take(ids, opts, key)
        pair.generate(ids, opts, session=s)
        cache.put(key, s)
        return s

    a = turn(pair.encode(PROMPTS[0]))
    a2 = turn(a.tokens + pair.encode("w9 w10"))  # the conversation goes on: same session
    assert a2 is a
    b = turn(a.tokens[:2] + pair.encode("w30 w31 w32 w33 w34 w35 w36 w37"))  # shares 2 tokens only
    assert b is not a and [s for _, s in cache.entries] == [a, b]
    c = turn(pair.encode(PROMPTS[1]))  # nothing shared: a new session evicts the oldest (a)
    assert c is not a and [s for _, s in cache.entries] == [b, c]
    assert cache.take(b.tokens, opts, ("lookup", 1, 4)) not in (b, c)  # another drafter: not shared
    assert cache.nbytes() > 0


@pytest.mark.parametrize("pieces, stops, want, hit", [
    (["hello wor", "ld, bye"], ["world"], "hello ", True),  # split across pieces
    (["ab", "c", "d"], ["cd"], "ab", True),
    (["abc"], ["x"], "abc", False),
    (["a<", "/s", "> after"], ["</s>"], "a", True),
    (["text <", "b> more"], ["</s>"], "text <b> more", False),  # a false start is released
    (["xbcd"], ["bcdef", "cd"], "xb", True),  # only the complete stop counts at the end
    (["xbcdef"], ["bcdef", "cd"], "x", True),  # the one that starts first wins
    (["tail ends in s"], ["s!"], "tail ends in s", False),  # held back, released at the end
])
def test_stop_scanner(pieces, stops, want, hit):
    scan = StopScanner(stops)
    out, stopped = [], False
    for p in pieces:
        text, stopped = scan.feed(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        text, stopped = scan.finish()
        out.append(text)
    assert "".join(out) == want and stopped == hit


def test_text_stream_pieces_add_up_to_the_decode(tmp_path):
    """A byte-level BPE (as Qwen's): a completion's leading space and characters split across
    tokens come out as `decode` gives them, whatever the pieces (mlx-lm's streaming
    detokenizer drops the first space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def f(x):\n    return x + 1\n", "héllo wörld \u4e2d\u6587", "    if x:\n        pass\n"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = "    return 1\n\n  x = 'h\u00e9 \U0001f642 \u4e2d' " * 3
    ids = hf.encode(text)
    assert hf.decode(ids) == text and len(ids) > 20
    for step in (1, 2, 5):
        for window in (1, 4, 16):
            s = TextStream(hf, window=window)
            pieces = [s.add(ids[i:i + step]) for i in range(0, len(ids), step)] + [s.finish()]
            assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
