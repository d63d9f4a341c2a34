"""The OpenAI-compatible server, through the official `openai` client on loopback."""

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import inspect
import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pydantic
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from blockpress.cli.common import load_model  # noqa: E402
from blockpress.generate import cut_at_stop, settled_text  # noqa: E402
from blockpress.serve import Batch, create_app, start_in_background  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 3, "max_new_tokens": 24}
    app = create_app(lm, MODEL, max_queue=64, max_batch=8)
    base, srv = start_in_background(app)
    yield base, app
    srv.should_exit = True


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_chat_and_completion(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                          seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content  # chat: min_tokens 1
    assert 1 <= chat.usage.completion_tokens <= 10 and chat.usage.prompt_tokens > 0
    comp = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, seed=2)
    assert comp.usage.completion_tokens <= 12
    assert comp.usage.model_extra["forward_passes"] >= 1


def test_streaming_reassembles_to_the_same_text(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=24, seed=7)
    whole = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
    assert "".join(parts) == whole
    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": "yo"}], max_tokens=20, seed=3)
    whole = client.chat.completions.create(**chat_kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **chat_kw)]
    assert "".join(parts) == whole


def test_streamed_chunks_add_up_across_canvas_boundaries(client, server):
    """Two ways a stream differed from the plain answer: a stop string split across two canvases had its first
    part sent already, and a character whose bytes straddle a canvas boundary came out as replacement
    characters (each canvas was decoded alone)."""
    def both(**kw):
        whole = client.completions.create(model=MODEL, **kw).choices[0].text
        parts = [c.choices[0].text for c in client.completions.create(model=MODEL, stream=True, **kw)]
        return whole, "".join(parts)

    # "€" is three bytes of the byte-level vocabulary: with 15 a's before it, the first canvas (16) ends inside it
    whole, streamed = both(prompt="x", extra_body={"template": "a" * 15 + "€€<|hole:4|>"}, max_tokens=40, seed=1)
    assert streamed == whole and whole.startswith("a" * 15 + "€€")
    for seed in range(40):  # stops the model writes across a canvas boundary (the tiny canvas is 16 tokens)
        text = client.completions.create(model=MODEL, prompt="hello", max_tokens=40, seed=seed).choices[0].text
        stop = text[14:17] if len(text) > 17 else "zz"
        whole, streamed = both(prompt="hello", max_tokens=40, seed=seed, stop=stop)
        assert streamed == whole, (seed, stop)
        # with min_tokens a stop inside the first tokens' text does not count, in the stream as in the answer
        whole, streamed = both(prompt="hello", max_tokens=40, seed=seed, stop=text[1:3] or "zz", extra_body={"min_tokens": 20})
        assert streamed == whole, (seed, "min_tokens")


@settings(max_examples=200, deadline=None)
@given(st.text("ab\ufffd", max_size=12), st.text("ab", max_size=6), st.lists(st.text("ab", min_size=1, max_size=3), max_size=3),
       st.integers(0, 6))
def test_settled_text_is_never_taken_back(text, more, stops, floor):
    """Whatever tokens come next, the text a stream has sent stays the start of the answer's text. (The engine's
    texts so far come cut at a stop string ending past the min_tokens' text, `floor`.)"""
    sent = settled_text(cut_at_stop(text, stops, floor), stops)
    assert cut_at_stop(text.rstrip("\ufffd") + more, stops, floor).startswith(sent)


def test_stream_usage_on_request(client, server):
    """OpenAI's stream_options.include_usage: one last chunk with no choices and the usage a plain request reports."""
    for create, kw in ((client.completions.create, dict(prompt="abc", max_tokens=12, seed=7, n=2)),
                       (client.chat.completions.create, dict(messages=[{"role": "user", "content": "yo"}],
                                                             max_tokens=10, seed=3))):
        plain = create(model=MODEL, **kw).usage
        chunks = list(create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[-1].choices == [] and all(c.choices for c in chunks[:-1])
        got = chunks[-1].usage
        assert (got.prompt_tokens, got.completion_tokens, got.total_tokens) == (
            plain.prompt_tokens, plain.completion_tokens, plain.total_tokens)
        assert all(c.usage is None for c in create(model=MODEL, stream=True, **kw))  # only when asked
    r = httpx.post(server[0] + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_drafts_without_a_stream_are_refused(server, path):
    """"drafts": true on a request that does not stream was answered as if absent, and still had the engine make
    and decode a draft every step for it, for its whole batch: a 400 naming the field, as stream_options gets."""
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(server[0] + path, timeout=30, json={"model": MODEL, "max_tokens": 4, "drafts": True, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "drafts", r.text
    assert httpx.post(server[0] + path, timeout=30, json={"model": MODEL, "max_tokens": 4, "drafts": False,
                                                          **body}).status_code == 200


@pytest.mark.parametrize("greedy", [dict(temperature=0), dict(sampler="greedy")])
def test_a_greedy_request_takes_top_p_and_top_k_as_openai_does(server, greedy):
    """OpenAI's clients send top_p beside temperature 0 by habit: the library now refuses a call's filters where
    nothing is drawn, and the server still takes them, changing nothing (the argmax is always kept)."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "seed": 5, **greedy}
    plain = httpx.post(server[0] + "/v1/completions", timeout=30, json=body)
    filtered = httpx.post(server[0] + "/v1/completions", timeout=30, json={**body, "top_p": 0.3, "top_k": 2})
    assert plain.status_code == filtered.status_code == 200, filtered.text
    assert filtered.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def sse_chunks(server, path, body):
    with httpx.stream("POST", server[0] + path, json={"model": MODEL, "stream": True, **body}, timeout=60) as r:
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_stream_chunks_in_openais_shape(server):
    """As OpenAI sends them: a chat choice's first delta names the role; legacy completion chunks are
    "text_completion" objects; with include_usage every chunk but the last has "usage": null."""
    chat = sse_chunks(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 8, "seed": 3, "n": 2})
    assert all(c["object"] == "chat.completion.chunk" for c in chat)
    for i in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chat if c["choices"][0]["index"] == i]
        assert deltas[0] == {"role": "assistant", "content": ""} and all("role" not in d for d in deltas[1:])
    plain = sse_chunks(server, "/v1/completions", {"prompt": "abc", "max_tokens": 8, "seed": 7,
                                                   "stream_options": {"include_usage": True}})
    assert all(c["object"] == "text_completion" for c in plain)
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] > 0
    # every choice has logprobs (null), as OpenAI's schema requires of it, chat's too (it was missing there)
    assert all(choice["logprobs"] is None for c in chat + plain for choice in c["choices"])


def test_a_streamed_chat_choice_ends_with_an_empty_delta(server):
    """Each streamed chat choice ends as OpenAI's does: a last chunk whose delta is {} beside its finish_reason
    (not {"content": ""})."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1, "n": 2, "temperature": 1.0}
    last = [c["choices"][0] for c in sse_chunks(server, "/v1/chat/completions", body) if c["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in last) == [0, 1] and all(c["delta"] == {} for c in last), last


def test_chat_choices_carry_the_fields_openais_schema_requires(server):
    """A chat choice had no "logprobs" and its message no "refusal", which OpenAI's schema requires (null here);
    strict typed clients refused the answer. A completions choice carries its null logprobs too, each prompt's."""
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "yo"}], "max_tokens": 4, "seed": 3, "n": 2})
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(c["logprobs"] is None and c["message"]["refusal"] is None for c in choices)
    assert all(c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str) for c in choices)
    r = httpx.post(server[0] + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == 200 and [c["logprobs"] for c in r.json()["choices"]] == [None, None], r.text


def test_draft_events_opt_in(server):
    """A stream that asks for drafts gets, beside its text, each denoising step's draft and the step it is of (a
    viewer orders and labels them by it)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True, "drafts": True, "seed": 1}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert any('"draft"' in x for x in lines) and lines[-1] == "data: [DONE]"
    drafts = [json.loads(x[6:])["blockpress"] for x in lines if '"blockpress"' in x]
    assert drafts and all(isinstance(d["draft"], str) and isinstance(d["step"], int) and d["step"] >= 0
                          for d in drafts), drafts


def test_concurrent_clients_get_what_they_get_alone(client):
    requests = [dict(model=MODEL, prompt="p" * (1 + i % 5), max_tokens=16, seed=100 + i,
                     temperature=0 if i % 2 else None) for i in range(32)]
    alone = [client.completions.create(**kw).choices[0].text for kw in requests[:8]]
    with cf.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda kw: client.completions.create(**kw), requests))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in together)
    assert [r.choices[0].text for r in together[:8]] == alone


def test_per_request_settings(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=8, seed=1,
                                  extra_body={"max_denoising_steps": 2, "sampler": "topk", "min_tokens": 8})
    assert r.usage.completion_tokens == 8 and r.usage.model_extra["forward_passes"] <= 2


def test_openai_penalties_reach_the_sampler(client):
    """presence_penalty / frequency_penalty (sent by many OpenAI clients) are honoured, as the library's own."""
    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 3, "max_new_tokens": 24}
    # (seed 0: with seed 5 the row meets EOS after 9 tokens, which the penalties leave alike)
    kw = dict(max_tokens=16, seed=0)
    texts = {}
    for pen in (0.0, 2.0):
        r = client.completions.create(model=MODEL, prompt="ab", presence_penalty=pen, frequency_penalty=pen / 2, **kw)
        texts[pen] = r.choices[0].text
        assert texts[pen] == lm.generate("ab", max_new_tokens=16, seed=0, presence_penalty=pen,
                                         frequency_penalty=pen / 2).texts[0]
    assert texts[0.0] != texts[2.0]


def concurrently(server, bodies):
    """Each body posted to /v1/completions at once (so they can share a batch): the responses, in order."""
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: httpx.post(server[0] + "/v1/completions", json={"model": MODEL, **b},
                                                  timeout=60), bodies))


@pytest.mark.parametrize("bad", [{"top_k": 10**30}, {"top_k": 2**63}, {"top_k": 2**31},
                                 {"stability_threshold": 10**30}, {"t_max": 1e308}, {"t_min": 1e308},
                                 {"entropy_bound": 1e308}, {"confidence_threshold": 1e39}])
def test_one_requests_bad_value_fails_it_alone_not_its_batchmates(server, bad):
    """A top_k past int64 passed validation, joined a batch and failed it whole: 500 for every request in it (a
    stability_threshold past int64 too; a t_max past float32 answered nothing, billed as tokens)."""
    good = [{"top_k": k, "seed": i} for i, k in enumerate((0, 40, 5))]
    bodies = [dict(prompt="def add(a, b):", max_tokens=8, temperature=0.8, **b) for b in [*good[:2], bad, good[2]]]
    rs = concurrently(server, bodies)
    param = next(iter(bad))
    assert rs[2].status_code == 400 and rs[2].json()["error"]["param"] == param, rs[2].text
    assert [r.status_code for r in rs[:2] + rs[3:]] == [200, 200, 200]


def test_a_value_only_the_library_refuses_fails_its_request_alone(server, monkeypatch):
    """The engine checks each request's job alone before it may join a batch: a value that the server's schema and
    sampler settings pass but the library refuses (here a seed, refused by a stand-in rule) gets its request a 400
    naming the field, where it used to fail the whole batch it joined with a 500."""
    import blockpress.lm

    check_seed = blockpress.lm.check_seed

    def unlucky(seed, name):
        if seed == 13:
            raise ValueError(f"{name}: 13 is refused here")
        return check_seed(seed, name)

    monkeypatch.setattr(blockpress.lm, "check_seed", unlucky)
    rs = concurrently(server, [dict(prompt="def f():", max_tokens=8, temperature=0.8, seed=s) for s in (1, 2, 13, 4)])
    assert rs[2].status_code == 400 and rs[2].json()["error"]["param"] == "seed", rs[2].text
    assert [r.status_code for r in rs[:2] + rs[3:]] == [200, 200, 200]


def test_the_librarys_checks_of_a_request_run_off_the_event_loop(server, monkeypatch):
    """Engine.check reads every prompt id (the library's checks: 3 ms for 4,000 ids). Run on the event loop, a
    request of 64 prompts of 4,000 ids held /health and every stream's next chunk 0.2 s; a worker thread runs
    them now, chat's and completions' alike, and a value they refuse is still that request's 400."""
    engine = server[1].state.engine
    on_loop, check = [], engine.check

    def recording(job):
        try:
            on_loop.append(asyncio.get_running_loop() is not None)
        except RuntimeError:  # no event loop in this thread
            on_loop.append(False)
        return check(job)

    monkeypatch.setattr(engine, "check", recording)
    common = {"model": MODEL, "max_tokens": 4, "n": 2, "temperature": 1.0}
    assert httpx.post(server[0] + "/v1/completions", json={**common, "prompt": ["a", "b"]}, timeout=60).status_code == 200
    assert httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                      json={**common, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert on_loop == [False] * 6


def test_a_chats_messages_are_checked_and_read_off_the_event_loop(server, monkeypatch):
    """Each message was checked and turned into the template's form on the event loop: a conversation of 50,000
    messages held /health 0.7 s there (0.3 s of it these; the rest is the body's parse). A worker thread does it
    now, and a message it refuses is still a 400 naming it."""
    from blockpress.serve import Message

    on_loop, for_template = [], Message.for_template

    def recording(message, i):
        try:
            on_loop.append(asyncio.get_running_loop() is not None)
        except RuntimeError:  # no event loop in this thread
            on_loop.append(False)
        return for_template(message, i)

    monkeypatch.setattr(Message, "for_template", recording)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and on_loop == [False] * 3
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [*turns, {"role": "tool", "content": "x"}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[3].tool_call_id"


# The sampler settings a request may send, each with values on both sides of the library's bounds.
SAMPLER_FIELDS = {
    **{name: st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e39]), st.floats(-2.0, 2.0))
       for name in ("entropy_bound", "confidence", "t_min", "t_max", "confidence_threshold")},
    "stability_threshold": st.one_of(st.integers(-3, 3), st.sampled_from([2**31 - 1, 2**31, 10**30])),
}


@settings(max_examples=200, deadline=None)
@given(values=st.fixed_dictionaries({}, optional=SAMPLER_FIELDS),
       sampler=st.sampled_from([None, "entropy_bound", "confidence", "topk", "greedy"]))
def test_the_server_takes_the_sampler_settings_the_library_takes(values, sampler):
    """The server refused `t_max: 0`, which the library and `generate --t-max 0` take: its schema restated the
    library's ranges, one of them otherwise. A request's sampler settings now pass or fail as SamplerConfig's do,
    with the library's own message and the field as param."""
    from blockpress.sampling import SamplerConfig
    from blockpress.serve import APIError, CompletionRequest, sampler_config

    defaults = SamplerConfig()
    try:
        want = defaults.with_(sampler=sampler, **values)
    except ValueError as exc:
        with pytest.raises(APIError) as refused:
            sampler_config(defaults, CompletionRequest(model="m", prompt="x", sampler=sampler, **values))
        assert refused.value.message == str(exc) and refused.value.param == str(exc).split(":")[0]
        return
    assert sampler_config(defaults, CompletionRequest(model="m", prompt="x", sampler=sampler, **values)) == want


def test_vllms_top_k_of_minus_one_and_a_negative_seed_are_taken():
    """OpenAI's seed is any int64 and vLLM's top_k -1 means all tokens; clients and UIs written for vLLM send -1 for
    "no top-k" or "any seed", and got 400s ("greater than or equal to 0"). top_k -1 is 0 (no filter); a negative
    seed is folded into the engine's range [0, 2**63) as seed % 2**63, so it repeats its answer like any seed."""
    from fastapi.testclient import TestClient

    from blockpress.serve import CompletionRequest, sampler_config

    lm = load_model("random-tiny", None, "cpu")
    sampled = {"model": MODEL, "prompt": "x", "temperature": 0.8}
    assert sampler_config(lm.sampler_defaults, CompletionRequest(**sampled, top_k=-1)) == \
        sampler_config(lm.sampler_defaults, CompletionRequest(**sampled, top_k=0))
    body = {**sampled, "prompt": "def add(a, b):", "max_tokens": 8, "max_denoising_steps": 2}
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:
        answers = [http.post("/v1/completions", json={**body, **extra})
                   for extra in ({"seed": -1}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"seed": 0},
                                 {"seed": 3, "top_k": -1}, {"seed": 3, "top_k": 0})]
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    texts = [r.json()["choices"][0]["text"] for r in answers]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[4] == texts[5]


NUMBER_FIELDS = ("top_k", "stability_threshold", "seed", "min_tokens", "temperature", "top_p", "entropy_bound",
                 "confidence", "t_min", "t_max", "confidence_threshold", "presence_penalty", "frequency_penalty")


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(NUMBER_FIELDS),
       value=st.integers(-(2**70), 2**70) | st.floats(-1e308, 1e308) | st.sampled_from([5e-324, 1e-320, 3.5e38]))
@example(name="top_k", value=10**30)
@example(name="stability_threshold", value=10**30)
@example(name="t_max", value=1e308)
def test_no_number_a_request_sends_is_a_server_error(server, name, value):
    """Whatever number a numeric field holds, the answer is a 200 or a 400 that names the field, never a 500."""
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                        "max_denoising_steps": 2, name: value}, timeout=60)
    assert r.status_code == 200 or (r.status_code == 400 and name in r.json()["error"]["message"]), (value, r.text)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "bogus_field": 1}, 400, "bogus_field"),
        ({"model": MODEL, "prompt": "x", "sampler": "beam"}, 400, "sampler"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),  # (-1 is vLLM's "all": 0)
        ({"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),  # past int64, as OpenAI's
        ({"model": MODEL, "prompt": "x", "t_min": 0.9, "t_max": 0.1}, 400, "t_max"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10, "min_tokens": 20}, 400, "min_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10_000_000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [5] * 131072, "max_tokens": 4}, 400, "prompt"),  # the prompt alone fills the context
        # the tokens fit, whole 16-token canvases do not: no canvas fits after the prompt / two do not after it
        ({"model": MODEL, "prompt": [5] * 131060, "max_tokens": 4}, 400, "prompt"),
        ({"model": MODEL, "prompt": [5] * 131050, "max_tokens": 20}, 400, "max_tokens"),
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "messages": []}, 400, None),
        ({"model": MODEL, "prompt": [99999]}, 400, "prompt"),
        # OpenAI's types, strictly: these were read as 5, 1, 2 and a NaN "above 2"
        ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": 2.0}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "temperature": float("nan")}, 400, "temperature"),
        # unimplemented OpenAI fields used for real
        ({"model": MODEL, "prompt": "x", "logprobs": 3}, 400, "logprobs"),
        # the legacy logprobs 0 still asks for the sampled tokens' log probabilities: it was answered with null
        ({"model": MODEL, "prompt": "x", "logprobs": 0}, 400, "logprobs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
         "tools"),
        ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
        # generated text leaves special tokens out: a stop holding one among other text could never match
        ({"model": MODEL, "prompt": "x", "stop": ["a", "a<end_of_turn>"]}, 400, "stop"),
    ],
)
def test_bad_requests_get_clean_4xx(server, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server[0] + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=30)  # json.dumps, as some clients do, writes NaN (httpx refuses to)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and (param is None or param in (err["param"] or "") or param in err["message"])


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize("body, bad", [
    ({"prompt": ...}, 1.5), ({"prompt": ...}, [1, "a"]), ({"prompt": "x", "stop": ...}, 1),
    ({"messages": ...}, {"role": "bogus", "content": 5}), ({"messages": [{"role": "user", "content": ...}]},
                                                             {"type": "text", "text": 5}),
    ({"messages": [USER], "tools": ...}, {"type": "function"}),
    ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": ...}]},
     {"id": "a", "type": "function", "function": {"name": "f", "arguments": "x"}}),
])
def test_a_list_of_many_bad_items_is_refused_at_its_first(server, body, bad):
    """Every bad item of a list was an error of its own, which FastAPI and the error handler read one by one on the
    event loop: a 1.5 MB prompt of 300,000 floats held every client 17.5 s for its 400. Validation stops at a list's
    first bad item now (each list form of a field: one error), and the 400 says what it said."""
    from blockpress.serve import ChatRequest, CompletionRequest

    def filled(value, items):
        if value is ...:
            return [bad] * items
        if isinstance(value, dict):
            return {k: filled(v, items) for k, v in value.items()}
        return [filled(v, items) for v in value] if isinstance(value, list) else value

    one, many = ({"model": MODEL, **filled(body, items)} for items in (1, 5000))
    kind, path = (ChatRequest, "/v1/chat/completions") if "messages" in body else (CompletionRequest, "/v1/completions")
    with pytest.raises(pydantic.ValidationError) as refused:
        kind.model_validate(many)
    assert refused.value.error_count() <= 4  # (a prompt's forms: text, ids, texts, lists of ids)
    answers = [httpx.post(server[0] + path, json=b, timeout=30) for b in (one, many)]
    assert answers[0].status_code == 400 and answers[0].json() == answers[1].json()


@pytest.mark.parametrize("route", ["completions", "messages", "parts", "stream_options"])
def test_many_unknown_fields_are_refused_by_the_first(server, route):
    """Each unknown field was an error of its own, read one by one on the event loop (100,000 unknown keys, 1.3 MB,
    held every client 1.7 s for the 400): the first alone is reported, named as it was."""
    from blockpress.serve import ChatRequest, CompletionRequest

    def body(unknown):
        extra = {f"k{i}": 1 for i in range(unknown)}
        if route == "completions":
            return {"model": MODEL, "prompt": "x", **extra}
        if route == "stream_options":
            return {"model": MODEL, "prompt": "x", "stream": True, "stream_options": extra}
        content = [{"type": "text", "text": "x", **extra}] if route == "parts" else "x"
        return {"model": MODEL, "messages": [{"role": "user", "content": content, **({} if route == "parts" else extra)}]}

    kind, path = (CompletionRequest, "/v1/completions") if "prompt" in body(0) else (ChatRequest, "/v1/chat/completions")
    with pytest.raises(pydantic.ValidationError) as refused:
        kind.model_validate(body(5000))
    assert refused.value.error_count() <= 2  # (content's forms: a text, a list of parts)
    one, many = (httpx.post(server[0] + path, json=body(n), timeout=30) for n in (1, 5000))
    assert one.status_code == 400 and one.json() == many.json() and "k0" in one.json()["error"]["message"]


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "\ud800"}, "prompt", "prompt: not valid UTF-8 (lone surrogate U+D800 at character 0)"),
    ({"prompt": "ab\udcff"}, "prompt", "prompt: not valid UTF-8 (byte 0xff at character 2)"),
    ({"prompt": ["x", "\ud800"]}, "prompt", "prompt[1]: not valid UTF-8"),
    ({"prompt": "x", "suffix": "y\ud800"}, "suffix", "suffix: not valid UTF-8 (lone surrogate U+D800 at character 1)"),
    ({"prompt": "x", "template": "ab\ud800<|hole|>"}, "template", "template: not valid UTF-8 (lone surrogate U+D800 "
                                                                   "at character 2)"),
    ({"prompt": "x", "stop": ["a", "\ud800"]}, "stop", "never match"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": "\ud83d"}, "stop", "never match"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "caf\udcff"}]},
     "messages[1].content", "messages[1].content: not valid UTF-8 (byte 0xff at character 3)"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[1].text", "not valid UTF-8 (lone surrogate U+D800 at character 0)"),
])
def test_text_that_is_not_utf8_is_a_400_naming_the_field(server, body, param, says):
    """JSON can carry half of a UTF-16 pair ("\\ud800": a JavaScript string cut inside an emoji). A prompt or suffix
    holding one was a bare 500 (the tokenizer's error message itself raised, and a ValueError from encoding was not
    caught), a chat message's error named a position in the rendered template, and a stop holding one was taken
    although generated text never can."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server[0] + path, content=json.dumps({"model": MODEL, "max_tokens": 2, **body}),
                   headers={"content-type": "application/json"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param, err
    assert says in err["message"], err


@pytest.mark.parametrize("body, param, forms", [
    ({"prompt": [1.5]}, "prompt", ["str", "list[int]", "list[str]", "list[list[int]]"]),
    ({"prompt": 5}, "prompt", ["str", "list[int]"]),
    ({"prompt": "x", "stop": [1, 2]}, "stop", ["str", "list[str]"]),
    ({"prompt": "x", "seed": 2**64}, "seed", None),
])
def test_a_field_of_several_types_names_them_all(server, body, param, forms):
    """Before: "prompt.str: Input should be a valid string", silent about the list form also accepted."""
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param
    for form in forms or []:
        assert form in err["message"]


def test_the_no_op_values_clients_send_are_accepted(server):
    """Clients and proxies that always send OpenAI's defaults (null tools, logprobs false, a text response format)
    are served (before: 400 "unknown field" on every request)."""
    noop = {"tools": None, "tool_choice": "none", "logprobs": False, "top_logprobs": None, "response_format":
            {"type": "text"}, "logit_bias": {}, "parallel_tool_calls": True}
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **noop})
    assert r.status_code == 200, r.text
    r = httpx.post(server[0] + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 4, "echo": False, "best_of": 1, "logprobs": None})
    assert r.status_code == 200, r.text
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=30, json={  # chat's logprobs is a yes or no
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "logprobs": 0,
        "top_logprobs": 0})
    assert r.status_code == 200, r.text


def test_openais_nullable_fields_take_null_as_their_default(server):
    """OpenAI documents n, stream and stream_options.include_usage as nullable; clients that write every unset field
    send null, which was refused ("n: Input should be a valid integer")."""
    def post(**body):
        return httpx.post(server[0] + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 2, "seed": 1, **body})

    r = post(n=None, stream=None)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text  # one choice, not a stream
    r = post(stream=True, stream_options={"include_usage": None})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert r.status_code == 200 and chunks and all("usage" not in c for c in chunks), r.text  # no usage asked


def test_fields_current_clients_send_are_accepted_where_they_ask_for_nothing(server):
    """openai>=1.99 sends stream_options.include_obfuscation; clients send store: false, metadata, service_tier
    "auto": all were "unknown field". Values that would need real behaviour are refused by name."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "seed": 1}
    labels = {"store": False, "metadata": {"run": "7"}, "service_tier": "auto", "modalities": ["text"],
              "safety_identifier": "u1", "prompt_cache_key": "k", "user": "u1", "stream": True,
              "stream_options": {"include_usage": True, "include_obfuscation": False}}
    r = httpx.post(server[0] + "/v1/chat/completions", json={**body, **labels}, timeout=60)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    for field, value in (("store", True), ("service_tier", "flex"), ("modalities", ["text", "audio"])):
        r = httpx.post(server[0] + "/v1/chat/completions", json={**body, field: value}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and "not supported" in err["message"], r.text


def test_openais_chat_fields_for_its_own_models_take_null_and_refuse_a_value_by_name(server):
    """The openai client sends null for reasoning_effort=None (and verbosity, audio, prediction, ...): each was
    400 "unknown field". Null passes; a value is refused naming the field, with what is accepted."""
    from blockpress.serve import CHAT_ONLY_NOOPS

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "seed": 1}
    labels = {"prompt_cache_retention": "in_memory", "prompt_cache_options": {"ttl": "30m"}, "verbosity": "medium"}
    r = httpx.post(server[0] + "/v1/chat/completions", json={**body, **dict.fromkeys(CHAT_ONLY_NOOPS), **labels},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert {"reasoning_effort", "verbosity", "audio", "prediction"} <= set(CHAT_ONLY_NOOPS)
    for field, value in (("reasoning_effort", "high"), ("verbosity", "low"), ("audio", {"voice": "x"})):
        r = httpx.post(server[0] + "/v1/chat/completions", json={**body, field: value}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field, r.text
        accepted = '"medium" or null' if field == "verbosity" else "null"
        assert err["message"].startswith(f"{field}: not supported by this server (") and \
            err["message"].endswith(f"; only {accepted} is accepted)"), err["message"]
    r = httpx.post(server[0] + "/v1/chat/completions", json={**body, "service_tier": "flex"}, timeout=60)
    assert r.json()["error"]["message"].endswith('; only "auto", "default" or null is accepted)'), r.text
    for field, value, accepted in (("echo", True, "false or null"), ("response_format", {"type": "json_object"},
                                                                      '{"type": "text"} or null')):
        r = httpx.post(server[0] + "/v1/completions" if field == "echo" else server[0] + "/v1/chat/completions",
                       json={**body, field: value} if field != "echo" else
                       {"model": MODEL, "prompt": "x", "max_tokens": 2, "echo": value}, timeout=60)
        # JSON, as the client sends it (Python's False and {'type': 'text'} would not parse if copied)
        assert r.json()["error"]["message"].endswith(f"; only {accepted} is accepted)"), r.text
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "reasoning_effort": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text  # a chat field only


def test_malformed_json(server):
    """A syntax error is the whole body's: its error names no param (FastAPI's loc holds the offset of the error
    there, which was sent as the param and put before the message). The message says why and where, as --input
    does: it said "not valid JSON" alone, and a raw newline in a string (a prompt typed over two lines in curl -d)
    left the client to guess; that one also says how a newline or tab is written."""
    for body, why in [(b"{nope", "Expecting property name enclosed in double quotes, character 1"),
                      (b'{"model": "tiny", "prompt": "x",}', "Expecting property name enclosed in double quotes, "
                                                             "character 32"),
                      (b"[1, 2", "Expecting ',' delimiter, character 5"),
                      (b'{"model": "tiny", "prompt": "def f():\n    return"}', "Invalid control character at, "
                       "character 37; a newline or tab inside a string is written \\n or \\t"),
                      (b'{"prompt": "a\tb"}', "Invalid control character at, character 13; a newline or tab inside a "
                                            "string is written \\n or \\t")]:
        r = httpx.post(server[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"the request body is not valid JSON ({why})", "type": "invalid_request_error", "param": None,
            "code": None}, (body, r.text)


class Waiting:
    """A stand-in for a queued job: all the queue reads of one is whether its client left."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()


@contextlib.contextmanager
def queue_of(engine, size: int, waiting: int = 0):
    """The engine's queue cut to `size` places, `waiting` of them taken by stand-ins (yielded), while the engine starts
    no batch (so they stay queued)."""
    held = [Waiting() for _ in range(waiting)]
    saved = engine.max_queue
    with engine.lock:
        engine._admit = lambda: None  # an instance attribute over the method, deleted below
        engine.max_queue = size
        engine.waiting += held
    try:
        yield held
    finally:
        with engine.lock:
            engine.waiting = [j for j in engine.waiting if j not in held]
            engine.max_queue = saved
            del engine._admit
            engine.arrived.notify()


def wait_idle(engine, timeout: float = 30.0) -> None:
    """Until the engine runs no batch and nothing waits (a client that left is noticed within a step)."""
    deadline = time.monotonic() + timeout
    while engine.batches or engine.depth():
        assert time.monotonic() < deadline, "the engine is still busy"
        time.sleep(0.01)


def wait_until(cond, what: str, requests=(), timeout: float = 30.0) -> None:
    """Until `cond()` holds, failing after `timeout` s with `what` (what was waited for), or at once with the answer of
    any of `requests` (futures of the requests sent) that ended first: a bare `while not cond()` loop spun until CI's
    own limit, naming no test, when the server refused a request (a 429) it should have queued, or never started."""
    deadline = time.monotonic() + timeout
    while not cond():
        for request in requests:
            if request.done():
                answer = request.result()  # (raises what the request raised)
                said = f"{answer.status_code} {answer.text}" if isinstance(answer, httpx.Response) else answer
                raise AssertionError(f"waiting for {what}: a request was answered first: {said}")
        assert time.monotonic() < deadline, f"waiting for {what}: still not so after {timeout} s"
        time.sleep(0.01)


def test_a_wait_fails_naming_what_it_waited_for_not_hangs():
    """A server that refused a request it should have queued, or never started, hung the suite's waits until CI's own
    limit: wait_until fails at once with the refusal, or after its time with what it waited for."""
    refused = cf.Future()
    refused.set_result(httpx.Response(429, text="the queue is full"))
    with pytest.raises(AssertionError, match="^waiting for the 2 requests to queue: a request was answered first: "
                                             "429 the queue is full$"):
        wait_until(lambda: False, "the 2 requests to queue", [refused])
    start = time.monotonic()
    with pytest.raises(AssertionError, match="^waiting for the server to start: still not so after 0.1 s"):
        wait_until(lambda: False, "the server to start", timeout=0.1)
    assert time.monotonic() - start < 5


def test_full_queue_answers_429(server):
    with queue_of(server[1].state.engine, 1, waiting=1):
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_a_client_that_left_frees_its_place_in_the_queue_at_once(server):
    """Jobs whose clients had left counted against max_queue until the engine next built a batch (after the running
    one's end, maybe minutes): a burst of clients that timed out got every later request a 429, and /health said
    the queue was full, while nobody was waiting."""
    engine = server[1].state.engine
    with cf.ThreadPoolExecutor(1) as pool, queue_of(engine, 3, waiting=3) as held:
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 429 and engine.depth() == 3
        for job in held[:2]:
            job.cancelled.set()  # their clients left
        assert httpx.get(server[0] + "/health").json()["queue_depth"] == 1
        assert "blockpress_queue_depth 1\n" in httpx.get(server[0] + "/metrics").text
        # queued now (it runs once the engine may start batches again, as the queue_of block ends)
        answer = pool.submit(httpx.post, server[0] + "/v1/completions", timeout=60,
                             json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 2, "temperature": 1})
        wait_until(lambda: engine.depth() >= 3, "the request's 2 rows to queue beside the one left", [answer])
        assert len(engine.waiting) == 3  # the two that left are gone, not kept beside it
    assert answer.result().status_code == 200


def test_a_plain_request_whose_client_left_is_noticed_without_asking(server, monkeypatch):
    """A plain request asked twice a second whether its client had left (request.is_disconnected), so a burst of
    clients that gave up held their queue places, and got the next clients 429s, for up to half a second more. It
    waits for the client's disconnect itself now, as a stream does: here one that is never asked is still seen."""
    from starlette.requests import Request

    async def never(self):
        return False

    monkeypatch.setattr(Request, "is_disconnected", never)
    engine = server[1].state.engine
    with queue_of(engine, 4):  # nothing starts: the request waits in the queue
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 3,
                                                            "temperature": 1.0}, timeout=0.5)
        deadline = time.monotonic() + 30
        while engine.depth():  # its 3 rows leave the queue
            assert time.monotonic() < deadline, "the request's rows still wait for a client that left"
            time.sleep(0.01)


def test_a_request_is_queued_whole_or_not_at_all(server):
    """n choices that did not all fit used to get a 429 while the choices queued before it ran for nobody."""
    engine = server[1].state.engine
    with queue_of(engine, 3, waiting=1):  # two places left
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 3})
        assert r.status_code == 429 and len(engine.waiting) == 1  # nothing of it was queued
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # it could never fit: not "retry later"


@pytest.mark.parametrize("prompts, n, param, says", [
    (["a", "b", "c", "d"], 1, "prompt", "prompt: 4 prompts (4 jobs)"),
    (["a", "b"], 2, "prompt", "prompt: 2 prompts x 2 choices (4 jobs)"),
    (["a", "b"], 4, "n", "n: 4 choices"),
    ("a", 4, "n", "n: 4 choices"),
])
def test_a_request_larger_than_the_queue_names_what_is_too_large(server, prompts, n, param, says):
    """A list of 4 prompts (n=1) was refused as "n: 4 choices (n for each prompt)"."""
    with queue_of(server[1].state.engine, 3):
        r = httpx.post(server[0] + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": prompts, "max_tokens": 4, "n": n, "temperature": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["message"].startswith(says), err
    assert "queue of 3" in err["message"]


def test_prompts_that_can_never_fit_the_queue_are_refused_at_the_first(server, monkeypatch):
    """Every prompt of a list was tokenized before the queue's refusal: 100,000 one-letter prompts (1 MB) took 29 s
    of a worker thread and 350 MB for that 400. It comes once the first prompt says how many jobs each takes."""
    lm, engine = server[1].state.server.lm, server[1].state.engine
    encoded = []
    encode = lm.tokenizer.encode_prompt
    monkeypatch.setattr(lm.tokenizer, "encode_prompt", lambda text, *a, **kw: encoded.append(text) or encode(text, *a, **kw))
    with queue_of(engine, 3):
        for n, jobs in ((1, 1000), (2, 2000)):
            r = httpx.post(server[0] + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": [f"p{i}" for i in range(1000)], "max_tokens": 4, "n": n, "temperature": 1})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "prompt", err
            assert err["message"].startswith(f"prompt: 1000 prompts{' x 2 choices' if n > 1 else ''} ({jobs} jobs) "
                                             "can never fit the server's queue of 3"), err
            assert encoded == ["p0"], encoded[:3]
            encoded.clear()
    ok = httpx.post(server[0] + "/v1/completions", timeout=30,
                    json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2, "max_denoising_steps": 1})
    assert ok.status_code == 200 and encoded == ["a", "b", "c"], ok.text


def test_temperature_zero_is_the_same_answer_every_time(client):
    kw = dict(model=MODEL, prompt="hello", max_tokens=16, temperature=0)
    texts = {client.completions.create(**kw).choices[0].text for _ in range(3)}
    assert len(texts) == 1
    assert len({c.text for c in client.completions.create(n=2, **kw).choices}) == 1


def test_min_tokens_beside_a_template_is_not_a_server_error(server):
    body = {"model": MODEL, "prompt": "# p\n", "template": "x = <|hole:4|>\n", "max_tokens": 100, "min_tokens": 80}
    r = httpx.post(server[0] + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("x = ")


def test_unknown_routes_and_models_answer_in_openais_error_shape(client, server):
    assert client.models.retrieve(MODEL).id == MODEL
    for method, path, status, code in (("GET", "/v1/nothing", 404, "unknown_url"),
                                       ("GET", "/v1/completions", 405, None),
                                       ("GET", "/v1/models/other", 404, "model_not_found")):
        r = httpx.request(method, server[0] + path)
        # OpenAI's: invalid_request_error with a code (a 404's "not_found_error" is a type OpenAI never sends)
        assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
        assert r.json()["error"]["code"] == code, (path, r.text)
    assert httpx.get(server[0] + "/v1/nothing").json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"
    r = httpx.post(server[0] + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (404, "model_not_found", "model")
    for content in (b"", b"[1, 2]"):
        r = httpx.post(server[0] + "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"], r.text


def test_a_405_allows_every_method_the_path_answers(server):
    """The routes that answer HEAD as well as GET said "Allow: GET" (RFC 9110: a 405's Allow lists the methods the
    resource supports), since Starlette names the first matching route's alone."""
    for path, allowed in (("/v1/models", "GET, HEAD"), (f"/v1/models/{MODEL}", "GET, HEAD"), ("/health", "GET, HEAD"),
                          ("/v1/completions", "POST"), ("/metrics", "GET")):
        assert httpx.head(server[0] + path).status_code in (200, 405), path
        r = httpx.put(server[0] + path, content=b"")
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text


def test_a_body_not_read_as_json_says_why(server):
    """A JSON object sent as text/json or application/jsonl (which FastAPI reads as bytes) was told it "must be a
    JSON object", with no word of the Content-Type that text/plain got; a body that is not UTF-8 got FastAPI's
    "There was an error parsing the body"."""
    from blockpress.serve import read_as_json

    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    for content_type in ("text/json", "application/jsonl", "text/plain; charset=utf-8", None):
        # (None: requests' post(data=json.dumps(...)) sends no Content-Type, which FastAPI 0.132 on reads as bytes)
        headers = {"content-type": content_type} if content_type else {}
        r = httpx.post(server[0] + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "the request body must be a JSON object sent with Content-Type: application/json (got "
            f"{content_type or 'none'})"), r.text
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json", "Application/JSON"):
        assert read_as_json(content_type), content_type
        r = httpx.post(server[0] + "/v1/completions", content=body, headers={"content-type": content_type})
        assert r.status_code == 200, (content_type, r.text)
    latin = json.dumps({"model": MODEL, "prompt": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    r = httpx.post(server[0] + "/v1/completions", content=latin, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "the request body is not valid JSON: not UTF-8 (byte 0xe9 at byte "), r.text


def test_a_compressed_body_gets_a_415_naming_the_encoding(server):
    """Nothing decodes a compressed request body: gzip's bytes were refused as "not UTF-8", and a plain JSON body
    labelled gzip was served as if it were not labelled; both are RFC 9110's 415, and the connection goes on."""
    import gzip

    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    with httpx.Client() as http:  # (one connection: it serves the next request after the 415)
        for content in (gzip.compress(body), body):
            r = http.post(server[0] + "/v1/completions", content=content,
                          headers={"content-type": "application/json", "content-encoding": "gzip"})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_encoding", r.text
            assert "'gzip'" in r.json()["error"]["message"]
        r = http.post(server[0] + "/v1/completions", content=body,
                      headers={"content-type": "application/json", "content-encoding": "Identity"})
        assert r.status_code == 200, r.text


def test_disconnect_frees_the_engine(server):
    counters = server[1].state.engine.metrics.counters
    before = dict(counters)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "min_tokens": 400, "stream": True, "drafts": True,
            "seed": 1, "max_denoising_steps": 8}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # the first event arrived; now the client goes away
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 4, "seed": 2},
                   timeout=60)
    assert r.status_code == 200
    wait_idle(server[1].state.engine)  # (the abandoned batch may run beside it until its client's leaving is seen)
    # the abandoned 400-token request never completed: the engine wrote far fewer tokens than it asked
    assert counters["completion_tokens_total"] - before["completion_tokens_total"] < 400
    assert (counters["cancelled_total"] - before["cancelled_total"], counters["requests_total"]
            - before["requests_total"]) == (1, 1)


def test_a_plain_request_whose_client_left_frees_the_engine(server):
    engine = server[1].state.engine
    before = engine.metrics.counters["completion_tokens_total"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "min_tokens": 2000, "n": 8, "seed": 1,
            "max_denoising_steps": 8}  # no early EOS: it would run for many seconds
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server[0] + "/v1/completions", json=body, timeout=0.3)  # the client gives up and closes
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 4, "seed": 2},
                   timeout=60)
    assert r.status_code == 200
    wait_idle(engine)
    # the abandoned 8 x 2,000 tokens stopped part way
    assert engine.metrics.counters["completion_tokens_total"] - before < 8 * 2000


def test_metrics_count_the_work_of_clients_that_left_and_the_requests_not_answered(server, monkeypatch):
    """/metrics added passes and tokens when a batch was done, which one whose clients all left never is (its
    work was missing from the load), and no counter saw a request that was not answered (499s, 5xx)."""
    engine = server[1].state.engine
    counters = engine.metrics.counters
    before = dict(counters)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "min_tokens": 400, "seed": 1, "max_denoising_steps": 8,
            "stability_threshold": 100}  # no early end: every canvas takes its 8 steps
    with httpx.stream("POST", server[0] + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        next(r.iter_lines())  # the first canvas is in; the client leaves
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 4, "seed": 2},
                   timeout=60)
    wait_idle(engine)  # the abandoned batch has stopped (it may run beside the follow-up until its client's leaving is seen)
    usage = r.json()["usage"]
    passes = counters["forward_passes_total"] - before["forward_passes_total"] - usage["forward_passes"]
    tokens = counters["completion_tokens_total"] - before["completion_tokens_total"] - usage["completion_tokens"]
    canvas = engine.lm.model.config.canvas_length
    assert canvas <= tokens < 400 and passes >= 8 * (tokens // canvas), (passes, tokens)  # before: 0 and 0
    assert counters["cancelled_total"] - before["cancelled_total"] == 1

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine.lm.model, "denoise", broken)
    plain = httpx.post(server[0] + "/v1/completions", json={**body, "max_tokens": 4, "min_tokens": 0}, timeout=60)
    with httpx.stream("POST", server[0] + "/v1/completions", timeout=60,
                      json={**body, "max_tokens": 4, "min_tokens": 0, "stream": True}) as s:
        events = [x for x in s.iter_lines() if x.startswith("data: ")]
    monkeypatch.undo()
    assert plain.status_code == 500 and "the device fell over" in events[-1]
    assert counters["failed_total"] - before["failed_total"] == 2
    assert counters["requests_total"] - before["requests_total"] == 1  # the follow-up
    text = httpx.get(server[0] + "/metrics").text
    assert "# TYPE blockpress_cancelled_total counter" in text and "# TYPE blockpress_failed_total counter" in text


def test_every_answer_carries_its_request_id_and_a_failures_log_line_names_it(server, monkeypatch, caplog):
    """An operator could not match a client's complaint to the server's log: no answer carried an id the log named.
    Each answer now sends X-Request-Id back (the client's, or one made, which the completion's id ends with), errors
    and streams included, and the log lines of a failure name it."""
    import blockpress.serve

    base, body = server[0], {"model": MODEL, "prompt": "x", "max_tokens": 4, "seed": 1}
    r = httpx.get(base + "/v1/models", headers={"X-Request-Id": "client-42"})
    assert r.headers["x-request-id"] == "client-42"
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    made = r.headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{24}", made) and r.json()["id"] == "cmpl-" + made
    r = httpx.post(base + "/v1/chat/completions", headers={"X-Request-Id": "abc"}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.headers["x-request-id"] == "abc" and r.json()["id"] == "chatcmpl-abc"
    for r in (httpx.post(base + "/v1/completions", json={**body, "model": "other"}, headers={"X-Request-Id": "e1"}),
              httpx.get(base + "/v1/nothing", headers={"X-Request-Id": "e1"})):
        assert r.status_code in (400, 404) and r.headers["x-request-id"] == "e1", r.text
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                      headers={"X-Request-Id": "s1"}, timeout=60) as s:
        assert s.headers["x-request-id"] == "s1" and s.headers["content-type"].startswith("text/event-stream")
        list(s.iter_lines())
    r = httpx.get(base + "/health", headers={"X-Request-Id": "has space " + "x" * 200})  # not one taken as sent
    assert re.fullmatch("[0-9a-f]{24}", r.headers["x-request-id"])

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    with caplog.at_level("ERROR", logger="blockpress.serve"):
        monkeypatch.setattr(server[1].state.server.lm.model, "denoise", broken)
        r = httpx.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "fails-7"}, timeout=60)
        assert r.status_code == 500 and r.headers["x-request-id"] == "fails-7"
        monkeypatch.undo()

        async def bug(*args, **kwargs):
            raise RuntimeError("a bug in a handler")

        monkeypatch.setattr(blockpress.serve, "completion_reply", bug)  # an error no handler answers
        r = httpx.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "bug-8"}, timeout=60)
        assert r.status_code == 500 and r.headers["x-request-id"] == "bug-8"
        assert r.json()["error"]["type"] == "server_error" and "bug-8" in r.json()["error"]["message"]
    lines = [record.getMessage() for record in caplog.records]
    assert any("a batch of 1 failed (requests fails-7)" in line for line in lines), lines
    assert "serve: request bug-8 failed on an internal error (its traceback follows)" in lines


def test_health_and_metrics_count_the_running_rows_and_clients_that_leave_free_them(server):
    """/health and /metrics said how many rows wait (queue_depth), not how many run, so that rows left running for
    nobody could not be seen from outside. running_rows counts the rows of running batches (those that hold a place
    of --max-batch): a request's sampled choices while it runs, none once clients that left mid-stream or
    mid-request are noticed."""
    engine = server[1].state.engine
    before = engine.metrics.counters["cancelled_total"]
    long = {"model": MODEL, "prompt": "x", "max_tokens": 400, "min_tokens": 400, "max_denoising_steps": 4,
            "stability_threshold": 100, "temperature": 1.0}  # every canvas takes its 4 steps

    def gauges():
        health, metrics = httpx.get(server[0] + "/health").json(), httpx.get(server[0] + "/metrics").text
        assert f"blockpress_running_rows {health['running_rows']}\n" in metrics  # (both read now: none is running)
        return health["running_rows"], health["queue_depth"]

    longer = {**long, "max_tokens": 1600, "min_tokens": 1600, "max_denoising_steps": 8}  # (runs on past the check)
    with httpx.stream("POST", server[0] + "/v1/completions", json={**longer, "n": 3, "seed": 1, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()  # (kept: a dropped iterator closes the stream, as a client that leaves)
        next(lines)  # the first chunk is in
        assert httpx.get(server[0] + "/health").json()["running_rows"] == 3

    def leave(i: int) -> None:
        if i % 2:
            with httpx.stream("POST", server[0] + "/v1/completions", json={**long, "seed": i, "stream": True},
                              timeout=60) as r:
                next(r.iter_lines())
        else:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(server[0] + "/v1/completions", json={**long, "seed": i}, timeout=0.3)

    with cf.ThreadPoolExecutor(10) as pool:
        list(pool.map(leave, range(10)))
    wait_idle(engine)
    assert gauges() == (0, 0) and engine.metrics.counters["cancelled_total"] - before == 11


def test_a_finished_batch_lets_go_of_its_stream_at_once(server, monkeypatch):
    """A batch's stream stops at its last event holding the batch's KV cache. The engine thread's list of the round
    it advanced kept the batches that finished in it until another round began, which an idle server never begins:
    the last round's caches stayed while nothing ran (blockpress-code, n=8 of 1,024 tokens: 52 MB). Now each
    stream is closed as its batch ends: answered (Done), left by its client (Cancelled), or failed in the server's
    own handling of an event (the stream itself still suspended at a Commit)."""
    engine = server[1].state.engine
    streams, stream = [], engine._stream

    def recording(jobs):
        events = stream(jobs)
        streams.append(events)  # (this list keeps a stream alive, as the engine's did, until it is closed)
        return events

    monkeypatch.setattr(engine, "_stream", recording)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "seed": 1}
    assert httpx.post(server[0] + "/v1/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", server[0] + "/v1/completions", timeout=60,
                      json={**body, "max_tokens": 400, "min_tokens": 400, "stream": True}) as r:
        next(r.iter_lines())  # the first canvas is in; the client leaves
    wait_idle(engine)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the server's handling of a commit")

    monkeypatch.setattr(Batch, "commit", broken)
    assert httpx.post(server[0] + "/v1/completions", json=body, timeout=60).status_code == 500
    wait_idle(engine)
    started = [s for s in streams if inspect.getgeneratorstate(s) != inspect.GEN_CREATED]  # (not Engine.check's)
    assert len(started) == 3 and [inspect.getgeneratorstate(s) for s in started] == [inspect.GEN_CLOSED] * 3


def test_an_error_closing_a_finished_batch_leaves_the_engine_serving(server, monkeypatch):
    """Batch.close ran outside any guard: one error there ended the engine thread, and every later request waited
    forever while /health said "ok". Now it is logged, and the next request is answered."""
    engine = server[1].state.engine
    wait_idle(engine)
    close, fired = Batch.close, []

    def failing(self):
        if not fired:
            fired.append(1)
            raise RuntimeError("a bug in closing a batch's stream")
        return close(self)

    monkeypatch.setattr(Batch, "close", failing)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "seed": 1}
    assert httpx.post(server[0] + "/v1/completions", json=body, timeout=10).status_code == 200  # answered, then closed
    wait_until(lambda: fired, "the answered batch to close")  # (its answer is sent before it closes)
    assert httpx.post(server[0] + "/v1/completions", json=body, timeout=10).status_code == 200
    assert engine.thread.is_alive() and httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_an_error_in_admitting_fails_the_waiting_requests_and_the_engine_goes_on(server, monkeypatch):
    """An error in Engine._admit (starting batches of the waiting jobs) ended the engine thread for good. Now the jobs
    waiting then get a 500 (kept queued, they could meet it again at every round) and the next request is answered."""
    engine = server[1].state.engine
    wait_idle(engine)
    admit, fired = type(engine)._admit, []

    def failing(self):
        if self.waiting and not fired:  # (not an idle round's: a request is waiting)
            fired.append(1)
            raise RuntimeError("a bug in starting a batch")
        return admit(self)

    monkeypatch.setattr(type(engine), "_admit", failing)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "seed": 1}
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 500 and "a bug in starting a batch" in r.json()["error"]["message"], r.text
    assert httpx.post(server[0] + "/v1/completions", json=body, timeout=10).status_code == 200
    assert engine.thread.is_alive() and engine.depth() == 0


def test_health_is_a_503_once_the_engine_thread_has_ended(server):
    """An engine thread ended by an error of ours answered nothing more, while /health said "ok" (a load balancer kept
    sending it traffic, each request waiting forever). Now /health is a 503 naming why, and a request a 503 at once."""
    from fastapi.testclient import TestClient

    app = create_app(server[1].state.server.lm, MODEL, prefix_cache_bytes=0)
    engine = app.state.engine

    def broken():
        raise RuntimeError("a bug outside any batch")

    engine._round = broken  # (an instance attribute over the method the thread calls)
    with TestClient(app) as http:
        engine.thread.join(10)
        assert not engine.thread.is_alive()
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "engine stopped", r.text
        assert "a bug outside any batch" in r.json()["reason"]
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"], r.text
        assert engine.metrics.counters["failed_total"] == 1  # (an error-rate alert sees it)
        engine.stopping = True  # closing: the thread may still run a step, and answers no new request
        assert http.get("/health").json()["status"] == "engine stopped"
    engine.failure = None
    assert engine.stopped() == "the server is shutting down"


def test_a_client_that_leaves_mid_canvas_frees_the_engine_within_a_step(server, monkeypatch):
    """Without drafts a stream has events only per canvas: a client that left was noticed when its canvas
    committed (minutes for a long one). Now every step is a chance to stop."""
    engine = server[1].state.engine
    calls = []
    denoise = engine.lm.model.denoise
    monkeypatch.setattr(engine.lm.model, "denoise", lambda *a, **k: (calls.append(1), denoise(*a, **k))[1])
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "min_tokens": 8, "seed": 1, "max_denoising_steps": 1024,
            "stability_threshold": 2000}  # one canvas of 1,024 steps: adaptive stopping never fires
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server[0] + "/v1/completions", json=body, timeout=0.3)
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 4, "seed": 2},
                   timeout=60)
    assert r.status_code == 200
    assert 0 < len(calls) < 1024  # the abandoned canvas stopped part way


def test_a_client_that_leaves_a_shared_batch_frees_its_row_for_the_next_request(server, monkeypatch):
    """Two clients in one batch, one leaves: its row stops and its place goes to the next request at once. The row
    ran on for nobody and held its place until the batch's end: a 0.5 s request waited 107 s behind a long one
    (blockpress-code, --max-batch 3)."""
    engine = server[1].state.engine
    monkeypatch.setattr(engine, "max_batch", 2)
    long = {"model": MODEL, "prompt": "x", "max_tokens": 1600, "min_tokens": 1600, "max_denoising_steps": 8,
            "stability_threshold": 2000, "stream": True}  # 100 canvases of 8 steps: adaptive stopping never fires
    leave, started = {k: threading.Event() for k in "ab"}, {k: threading.Event() for k in "ab"}

    def stream(k: str, seed: int) -> None:
        with httpx.stream("POST", server[0] + "/v1/completions", json={**long, "seed": seed}, timeout=120) as r:
            for _line in r.iter_lines():
                started[k].set()
                if leave[k].is_set():
                    return

    with engine.lock:
        engine._admit = lambda: None  # both queue first, so that they start as one batch
    with cf.ThreadPoolExecutor(2) as pool:
        try:
            a, b = pool.submit(stream, "a", 1), pool.submit(stream, "b", 2)
            wait_until(lambda: engine.depth() >= 2, "both streams to queue", [a, b])
        finally:
            with engine.lock:
                del engine._admit
                engine.arrived.notify()
        assert started["a"].wait(60) and started["b"].wait(60)
        assert [len(batch.jobs) for batch in engine.batches] == [2]
        leave["a"].set()
        a.result(timeout=60)
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 4, "seed": 3},
                       timeout=120)
        assert r.status_code == 200 and not b.done()  # answered beside the batch, not after it
        leave["b"].set()
        b.result(timeout=60)
    wait_idle(engine)


def test_a_client_that_leaves_a_batch_before_its_first_canvas_leaves_its_batchmates_answered(server, monkeypatch):
    """A batch is dropped unstarted only when every client of it has left: one whose clients partly left runs for
    those that stay (dropped when any had left, its other requests were never answered). Here request A runs, a batch
    B of one client that leaves and one that stays is admitted beside it, and the leaver goes before B's first
    canvas (A is held before its second, which the round that admitted B runs first)."""
    engine = server[1].state.engine
    stream = engine._stream
    reached, gate = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]

    def gated(batch):  # only A (seed 11) is held: before its first canvas, and before its second
        events = stream(batch)
        if batch[0].seed != 11:
            return events

        def held():
            reached[0].set()
            gate[0].wait(30)
            for event in events:
                yield event
                if type(event).__name__ == "Commit" and not reached[1].is_set():
                    reached[1].set()
                    gate[1].wait(30)
        return held()

    monkeypatch.setattr(engine, "_stream", gated)
    pool = cf.ThreadPoolExecutor(2)
    leaver = None
    try:
        a = pool.submit(httpx.post, server[0] + "/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 17, "min_tokens": 17, "seed": 11})
        assert reached[0].wait(30)
        b = {"model": MODEL, "prompt": "y", "max_tokens": 2, "seed": 5}
        data = json.dumps(b).encode()
        host, port = server[0].removeprefix("http://").split(":")
        leaver = socket.create_connection((host, int(port)))  # a client that sends its request, then closes
        leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        stays = pool.submit(httpx.post, server[0] + "/v1/completions", json={**b, "seed": 6}, timeout=10)
        deadline = time.monotonic() + 30
        while engine.depth() < 2:
            assert time.monotonic() < deadline, "B's two requests did not queue"
            time.sleep(0.01)
        gate[0].set()  # A's first canvas; the next round admits B and holds A before its second
        assert reached[1].wait(30)
        with engine.lock:
            shapes, new = [len(batch.jobs) for batch in engine.batches], engine.batches[-1]
        assert shapes == [1, 2] and new.events is None, shapes  # B is admitted, not started
        leaver.close()
        while not any(j.cancelled.is_set() for j in new.jobs):
            assert time.monotonic() < deadline, "the leaver's leaving was not seen"
            time.sleep(0.01)
        gate[1].set()
        r = stays.result()  # (dropped with the leaver, it is never answered: httpx's timeout)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
        assert a.result().status_code == 200
    finally:
        for g in gate:
            g.set()
        if leaver is not None:
            leaver.close()
        pool.shutdown(wait=True)
    wait_idle(engine)


def test_metrics_count_a_request_once_however_many_choices(client, server):
    metrics = server[1].state.engine.metrics
    counters = metrics.counters
    before = (counters["requests_total"], metrics.latency_count, counters["prompt_tokens_total"])
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="abc", max_tokens=8, n=3, seed=5)
        if stream:
            list(client.completions.create(stream=True, **kw))
        else:
            prompt_tokens = client.completions.create(**kw).usage.prompt_tokens
    after = (counters["requests_total"], metrics.latency_count, counters["prompt_tokens_total"])
    assert [a - b for a, b in zip(after, before)] == [2, 2, 2 * prompt_tokens]
    # the reused part of a prompt counts once a request too (it was once a choice: more than the prompt itself)
    cached = counters["cached_prompt_tokens_total"]
    again = client.completions.create(model=MODEL, prompt="abc " * 20, max_tokens=4, n=3, seed=6)
    again = client.completions.create(model=MODEL, prompt="abc " * 20, max_tokens=4, n=3, seed=6)
    reused = again.usage.prompt_tokens_details.cached_tokens
    assert reused > 0 and counters["cached_prompt_tokens_total"] - cached <= reused + again.usage.prompt_tokens


def test_cached_prompt_tokens_count_once_however_many_choices(server):
    """n sampled choices share their prompt, so the prefix cache's reuse counts once a prompt: cached_tokens is at
    most prompt_tokens (summed over the choices, it was n times the reuse)."""
    body = {"model": MODEL, "prompt": "def cached(prompt): return prompt * 2", "max_tokens": 2, "seed": 3,
            "temperature": 1.0}
    assert httpx.post(server[0] + "/v1/completions", json=body, timeout=60).status_code == 200  # cached now
    usage = httpx.post(server[0] + "/v1/completions", json={**body, "n": 3}, timeout=60).json()["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage


def test_the_choices_that_reuse_what_their_first_kept_add_no_cached_tokens():
    """A prompt new to the cache is encoded once for all its n choices: the first one encodes it, the others reuse
    what it kept (prefix.encode_prompts). That is no cached token: the prompt's reuse is its least choice's."""
    from types import SimpleNamespace

    from blockpress.serve import JobDone, Usage

    usage = Usage()
    for group, reused in ((0, 0), (0, 39), (0, 39), (1, 12), (1, 12)):
        usage.add(SimpleNamespace(copies=1, group=group), JobDone("", 1, 1, "length", reused))  # type: ignore[arg-type]
    assert usage.cached == 12 and usage.completion == 5


def test_a_prompt_twice_in_one_request_on_an_empty_cache_counts_no_cached_token():
    """A prompt repeated in a batch is encoded once (its repeats reuse what the first kept), but nothing of it was
    cached before the request: a list of the same prompt twice, or n choices, reported the repeat as cached."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2}
    prompt = "one two three four five six seven eight nine ten eleven twelve " * 3
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=1 << 26)) as http:
        for body in ({"prompt": [prompt, prompt]}, {"prompt": "fresh " + prompt, "n": 3, "temperature": 1.0}):
            r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "seed": 1, **body})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (body, r.json()["usage"])
        again = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "seed": 1, "prompt": prompt})
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # kept by the first request


def test_the_cached_tokens_of_several_prompts_add_up(server):
    """A list of prompts is several prompts: its cached_tokens is the sum of each one's reuse, as its prompt_tokens
    is the sum of theirs (taking the largest one's reused undercounted it)."""
    prompts = ["def alpha(x): return x + 1  # " * 3, "class Beta: pass  # beta beta " * 3]
    body = {"model": MODEL, "max_tokens": 2, "seed": 1}

    def usage(prompt):
        r = httpx.post(server[0] + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    usage(prompts)  # cached now
    alone = [usage(p)["prompt_tokens_details"]["cached_tokens"] for p in prompts]
    both = usage(prompts)
    assert min(alone) > 0 and both["prompt_tokens_details"]["cached_tokens"] == sum(alone), (alone, both)


def test_metrics(server):
    text = httpx.get(server[0] + "/metrics").text
    assert "blockpress_requests_total" in text and "blockpress_request_seconds_count" in text


def test_token_healing_field(client, server):
    lm = server[1].state.engine.lm
    r = client.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=8, seed=5,
                                  extra_body={"token_healing": True})
    direct = lm.generate("def f(x):\n", max_new_tokens=8, seeds=[5], token_healing=True)
    assert r.choices[0].text == direct.texts[0]


def test_a_chat_request_asking_for_token_healing_is_refused_as_generate_chat_refuses_it(client, server):
    """A chat prompt ends with the chat template's turn header: `generate --chat --token-healing` refused it, while
    the server (and lm.chat) healed the template's own newline and answered another reply. Each refuses it by name;
    lm.chat heals a final message it continues, whose text ends the prompt."""
    import openai

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       extra_body={"token_healing": True})
    assert caught.value.body["param"] == "token_healing" and "turn header" in caught.value.body["message"]
    lm = server[1].state.engine.lm
    with pytest.raises(ValueError, match="^token_healing: not with a chat prompt that ends with the chat template's"):
        lm.chat(messages, max_new_tokens=8, token_healing=True)
    continued = [*messages, {"role": "assistant", "content": "def f(x):\n"}]
    out = lm.chat(continued, template_options={"continue_final_message": True}, max_new_tokens=8, token_healing=True,
                  seeds=[1])
    ids = lm.chat_prompt(continued, continue_final_message=True)
    assert out.texts == lm.generate(ids, max_new_tokens=8, token_healing=True, seeds=[1]).texts


def test_stop_ends_the_request_early_and_cuts_the_text(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=24, seed=7)
    whole = client.completions.create(**kw)
    text = whole.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.completions.create(stop=[stop, "\x00never"], **kw)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # The engine ended the row at the stop: fewer tokens were generated, not merely hidden.
    assert cut.usage.completion_tokens < whole.usage.completion_tokens
    parts = [c.choices[0].text for c in client.completions.create(stream=True, stop=stop, **kw)]
    assert "".join(parts) == cut.choices[0].text


def test_a_stop_that_is_a_special_tokens_text_ends_the_request_at_that_token(client, server, monkeypatch):
    """The library's rule, through the server: stop="<start_of_turn>" (not an EOS) never matched, as the text the
    engine searches leaves special tokens out; now the row ends at the token, its text before it."""
    lm = server[1].state.engine.lm
    tok, c = lm.tokenizer, lm.config.canvas_length
    a, b, sot = tok.encode("a")[0], tok.encode("b")[0], tok.token_to_id("<start_of_turn>")
    pattern = torch.tensor([a, b, sot] + [a] * (c - 3))  # every canvas: a b <start_of_turn> a a ...

    def force(logits, rows):
        out = torch.full_like(logits, -1e4)
        out[:, torch.arange(c), pattern] = 10.0
        return out
    monkeypatch.setattr(lm, "stream", functools.partial(lm.stream, logits_processor=force))
    kw = dict(model=MODEL, prompt="x", max_tokens=24, seed=1)
    assert client.completions.create(**kw).choices[0].text.startswith("abaa")  # written, not shown: never matched
    cut = client.completions.create(stop="<start_of_turn>", **kw)
    assert cut.choices[0].text == "ab" and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == 3  # through the special token, as through an EOS
    parts = [ch.choices[0].text for ch in client.completions.create(stream=True, stop=["<start_of_turn>"], **kw)]
    assert "".join(parts) == "ab"


def test_a_chat_reuses_its_earlier_turns(client, server):
    """The second turn resends the first: its prompt's shared tokens come from the prefix cache (reported as
    OpenAI's cached_tokens), and the reply is what a plain generation of the whole prompt gives."""
    lm, engine = server[1].state.engine.lm, server[1].state.engine
    turn1 = [{"role": "system", "content": "You answer in one short line, always."},
             {"role": "user", "content": "name a prime number"}]
    first = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=8, seed=11, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and another one"}]
    before = engine.metrics.counters["cached_prompt_tokens_total"]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, seed=12, temperature=0)
    ids1 = lm.tokenizer.apply_chat_template(turn1, add_generation_prompt=True, tokenize=True)
    ids2 = lm.tokenizer.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True)
    shared = next(i for i, (a, b) in enumerate(zip(ids1 + [None], ids2)) if a != b)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert shared > 16 and cached >= shared  # at least the first turn's prompt (an earlier test may share more)
    assert engine.metrics.counters["cached_prompt_tokens_total"] - before == cached
    metrics = dict(line.split(" ") for line in httpx.get(server[0] + "/metrics").text.splitlines() if "{" not in line and not line.startswith("#"))
    assert int(metrics["blockpress_prefix_cache_entries"]) >= 1
    assert int(metrics["blockpress_prefix_cache_bytes"]) == engine.prefix_cache.nbytes > 0
    direct = lm.generate([ids2], max_new_tokens=8, seeds=[12], sampler="greedy", min_new_tokens=1)  # chat's default
    assert second.choices[0].message.content == direct.texts[0]


def test_a_temperature_samples_even_where_the_model_decodes_greedily():
    """blockpress-code decodes greedily by default: a request's temperature > 0 still samples (OpenAI's meaning),
    so n choices differ and seeds matter; temperature 0 stays one answer (before: n identical choices)."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"sampler": "greedy", "max_denoising_steps": 3}
    with TestClient(create_app(lm, MODEL)) as http:
        def texts(**kw):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 16, **kw}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return [c["text"] for c in r.json()["choices"]]

        assert len(set(texts(temperature=1.0, n=3, seed=1))) == 3
        assert texts(temperature=1.0, seed=1) != texts(temperature=1.0, seed=2)
        assert texts(temperature=1.0, seed=5) == texts(temperature=1.0, seed=5)
        assert len(set(texts(temperature=0, n=2))) == 1
        # n greedy choices are one answer: computed once, billed n times
        one, three = (http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 16,
                                                         "temperature": 0, "n": n}).json() for n in (1, 3))
        assert [c["index"] for c in three["choices"]] == [0, 1, 2]
        assert {c["text"] for c in three["choices"]} == {one["choices"][0]["text"]}
        assert three["usage"]["forward_passes"] == one["usage"]["forward_passes"]
        assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
        chunks = []
        with http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
                "n": 2, "stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        per_choice = ["".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"] if c["index"] == i)
                      for i in (0, 1)]
        assert per_choice[0] == per_choice[1] and per_choice[0]
        # sampled choices: choice 1 of seed 7 is not the answer to seed 8
        sampled = texts(temperature=1.0, n=2, seed=7)
        assert sampled[0] == texts(temperature=1.0, seed=7)[0] and sampled[1] != texts(temperature=1.0, seed=8)[0]


def test_temperature_0_keeps_the_sampler_a_request_names():
    """`"sampler": "topk", "temperature": 0` ran the greedy sampler (its acceptance rule swapped, a `confidence` sent
    with the confidence sampler never read). Now it runs the sampler named over argmax candidates, as a greedy
    request does otherwise: one answer for n choices, the same with no seed; without a sampler 0 is still greedy."""
    from fastapi.testclient import TestClient

    from blockpress.serve import CompletionRequest, sampler_config

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"sampler": "greedy", "max_denoising_steps": 3}
    for sampler in ("topk", "confidence"):
        body = CompletionRequest(model=MODEL, prompt="x", temperature=0, sampler=sampler)
        cfg = sampler_config(lm.sampler_defaults, body)
        assert cfg.sampler == sampler and cfg.candidates == "argmax"
    assert sampler_config(lm.sampler_defaults, CompletionRequest(model=MODEL, prompt="x", temperature=0)).sampler == "greedy"
    with TestClient(create_app(lm, MODEL)) as http:
        def texts(**kw):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 16, "temperature": 0, "sampler": "topk", **kw}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return [c["text"] for c in r.json()["choices"]], r.json()["usage"]["forward_passes"]

        (three, passes3), (one, passes1) = texts(n=3), texts()
        assert set(three) == set(one) and len(three) == 3 and passes3 == passes1  # computed once
        direct = lm.generate("hello", max_new_tokens=16, sampler="topk", candidates="argmax", seed=0)
        assert one == direct.texts


def test_prefix_cache_can_be_off():
    lm = load_model("random-tiny", None, "cpu")
    assert create_app(lm, MODEL, prefix_cache_bytes=0).state.engine.prefix_cache is None
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        create_app(lm, MODEL, prefix_cache_bytes=-1)


def test_server_limits_are_counts_not_flags_or_text():
    """create_app's limits took True as 1 (isinstance(True, int)): max_batch=True served batches of one, and
    prefix_cache_bytes="1" failed in a comparison with Python's TypeError. Each is refused by name; numpy integers,
    which the library's counts take, are taken here too."""
    lm = load_model("random-tiny", None, "cpu")
    for name in ("max_queue", "max_batch", "max_stops", "max_context", "max_body_bytes"):
        for bad in (True, "4", 2.0):
            with pytest.raises(ValueError, match=rf"^{name}: expected a positive integer"):
                create_app(lm, MODEL, prefix_cache_bytes=0, **{name: bad})
    for bad in (True, "1", -1):
        with pytest.raises(ValueError, match=r"^prefix_cache_bytes: expected 0 \(off\) or more"):
            create_app(lm, MODEL, prefix_cache_bytes=bad)
    from fastapi.testclient import TestClient

    app = create_app(lm, MODEL, prefix_cache_bytes=np.int64(0), max_batch=np.int64(3), max_context=np.int64(40))
    assert app.state.engine.max_batch == 3
    with TestClient(app) as http:  # a limit that responses carry is written as JSON
        assert http.get("/v1/models").status_code == 200 and http.get("/health").status_code == 200


def test_max_context_is_at_most_the_models():
    """A max_context past max_position_embeddings was taken, and requests then met the library's limit instead of
    the server's; it is refused, naming the field and the model's context."""
    lm = load_model("random-tiny", None, "cpu")
    limit = lm.config.text.max_position_embeddings
    for bad in (limit + 1, 0, -5, 2.5):
        with pytest.raises(ValueError, match=rf"^max_context: expected a positive integer of at most the model's "
                                             rf"context of {limit} tokens \(max_position_embeddings\), got {bad}"):
            create_app(lm, MODEL, prefix_cache_bytes=0, max_context=bad)
    from fastapi.testclient import TestClient

    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_context=40)) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 40})
        assert r.status_code == 400 and "exceed the context of 40 tokens" in r.json()["error"]["message"]


def test_models_say_the_context_requests_may_take_as_max_model_len():
    """/v1/models said nothing of the context, so a client could not size its prompts (vLLM's entries carry
    max_model_len): it is the limit requests are refused past, --max-context where given, else the model's."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    for max_context, limit in ((None, lm.config.text.max_position_embeddings), (40, 40)):
        with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_context=max_context)) as http:
            listed, one = http.get("/v1/models").json()["data"][0], http.get(f"/v1/models/{MODEL}").json()
            assert listed["max_model_len"] == one["max_model_len"] == limit, (listed, one)
            if max_context is not None:  # the limit requests meet
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 24, "max_tokens": 16})
                assert r.status_code == 200, r.text
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 25, "max_tokens": 16})
                assert r.status_code == 400 and "exceed the context of 40 tokens" in r.text, r.text
                # max_tokens counts in whole canvases (docs/serving.md): 25 + 15 takes 25 + 16 positions, refused;
                # 20 + 5 takes 20 + 16, which fit
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 25, "max_tokens": 15})
                assert r.status_code == 400 and "exceed the context of 40 tokens" in r.text, r.text
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 20, "max_tokens": 5})
                assert r.status_code == 200, r.text


def test_a_request_without_max_tokens_near_the_context_gets_what_fits():
    """A request that sends no max_tokens gets the model's default cut to the whole canvases the context has left,
    as vLLM gives what fits and `blockpress chat` shortens its reply: a 20-token prompt under a 40-token context (one
    16-token canvas left) got a 400 naming the default, "max_tokens: 20 prompt tokens + max_tokens 24 (whole 16-token
    canvases: 32 positions) exceed the context of 40 tokens", though the client sent none. Where not even one canvas,
    or min_tokens, fits, the 400 says so; a max_tokens that was sent is refused as before."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 24}
    assert lm.config.canvas_length == 16
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_context=40)) as http:
        def post(route, **body):
            return http.post(f"/v1/{route}", json={"model": MODEL, "temperature": 0, **body})

        r = post("completions", prompt=[5] * 20, min_tokens=16)
        assert r.status_code == 200, r.json()
        assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"
        r = post("completions", prompt=[5] * 20)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16
        r = post("chat/completions", messages=[{"role": "user", "content": "hi"}])  # 18 tokens with the template
        assert r.status_code == 200, r.json()
        assert 40 - 32 < r.json()["usage"]["prompt_tokens"] <= 40 - 16 and r.json()["usage"]["completion_tokens"] <= 16
        for body, param, says in (
                (dict(prompt=[5] * 25), "prompt", "25 prompt tokens leave room for 0 new tokens (whole 16-token "
                                                  "canvases) in the context of 40 tokens, too few for one 16-token canvas"),
                (dict(prompt=[5] * 20, min_tokens=17), "min_tokens", "too few for min_tokens 17"),
                (dict(prompt=[5] * 20, max_tokens=24), "max_tokens", "max_tokens 24 (whole 16-token canvases: 32 "
                                                                     "positions) exceed the context of 40 tokens")):
            err = post("completions", **body).json()["error"]
            assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_min_tokens_past_the_default_length_raises_the_default(route):
    """min_tokens 100 with no max_tokens, on blockpress-code (default 64 new tokens, a 4,096-token context), got "400
    min_tokens: 100 is more than max_tokens 64", a max_tokens the client never sent. The default now grows to it,
    as vLLM's (the context's room) takes it; past the room it is still refused, and a max_tokens sent still binds."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 24}
    body = dict(prompt=[5] * 4) if route == "completions" else dict(messages=[{"role": "user", "content": "hi"}])
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_context=120)) as http:
        def post(**extra):
            return http.post(f"/v1/{route}", json={"model": MODEL, "temperature": 0, **body, **extra})

        r = post(min_tokens=40)  # past the default 24, within the room (80 or 96 tokens: whole 16-token canvases)
        assert r.status_code == 200, r.json()
        assert r.json()["usage"]["completion_tokens"] >= 40
        err = post(min_tokens=40, max_tokens=24).json()["error"]
        assert err["param"] == "min_tokens" and "min_tokens: 40 is more than max_tokens 24" in err["message"], err
        err = post(min_tokens=200).json()["error"]
        assert err["param"] == "min_tokens" and "too few for min_tokens 200" in err["message"], err


def test_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(monkeypatch):
    """The handlers tokenized a prompt of any size on the event loop, and the tokenizer holds the GIL: a 3 MB prompt
    held /health (and every stream in flight) for 8.6 s, a 20 MB one for 85 s and 3.6 GB, all for the 400 its
    token count then got. Text longer than the context times the vocabulary's longest token cannot fit whatever its
    tokens: a prompt, a chat's messages, a suffix or a template of that size is refused without tokenizing it."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    most = 40 * lm.tokenizer.longest_token()
    assert most >= 40
    encoded = []
    encode = lm.tokenizer.encode
    monkeypatch.setattr(lm.tokenizer, "encode", lambda text, *a, **k: (encoded.append(len(text)), encode(text, *a, **k))[1])
    big = "a" * (most + 1)
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_context=40)) as http:
        for route, body, param in (
                ("completions", {"prompt": big}, "prompt"),
                ("completions", {"prompt": ["x", big]}, "prompt"),
                ("completions", {"prompt": "x", "suffix": big, "max_tokens": 4}, "suffix"),
                ("completions", {"prompt": "x", "template": big, "max_tokens": 4}, "template"),
                ("chat/completions", {"messages": [{"role": "system", "content": big[: most // 2]},
                                                   {"role": "user", "content": [{"type": "text", "text": big[most // 2:]}]}]},
                 "messages")):
            err = http.post(f"/v1/{route}", json={"model": MODEL, **body}).json()["error"]
            assert err["param"] == param and f"{most + 1} characters cannot fit the context of 40 tokens" in \
                err["message"], err
        assert all(n <= most for n in encoded), encoded  # (the batch's short prompt "x" is tokenized first)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": big[:-1]})  # at the bound: its tokens count
        assert r.status_code == 400 and "prompt tokens" in r.json()["error"]["message"] and encoded[-1] == most


def test_a_suffix_or_template_near_the_end_of_the_context_is_answered_or_refused_naming_what_to_shorten():
    """A suffix request with no max_tokens had the default cut to the context's room beside the prompt alone, then
    the suffix added: a 400 naming the prompt where a shorter fill fits (as it does without the suffix). A template
    was checked as if max_tokens (sent or the default) were its length: a 400 naming a max_tokens never sent, for a
    template that fits. A suffix too long to fit was blamed on the prompt."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 24}
    prompt = "hi " * 8  # 25 tokens: room for one 16-token canvas in a context of 48
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_context=48)) as http:
        def post(**body):
            return http.post("/v1/completions", json={"model": MODEL, "seed": 1, **body})

        r = post(prompt=prompt, suffix="b")
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 15, r.text  # 15 holes + "b": 16
        assert post(prompt=prompt, suffix="b", max_tokens=15).json()["choices"] == r.json()["choices"]
        for body in ({}, {"max_tokens": 24}):
            assert post(prompt=prompt, template="x<|hole:4|>", **body).status_code == 200
        # a limit past any context is refused before a canvas of that many holes is built (a 500, or gigabytes)
        for limit in ("max_tokens", "min_tokens"):
            r = post(prompt=prompt, suffix="b", **{limit: 10**12})
            assert r.status_code == 400 and r.json()["error"]["param"] in ("max_tokens", "min_tokens"), r.text
        # a min_tokens above the default raises it, as without a suffix (not a 400 naming a max_tokens never sent)
        r = post(prompt="hi", suffix="b", min_tokens=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 30, r.text
        for body, param in (({"prompt": "hi", "suffix": "a " * 40, "max_tokens": 8}, "suffix"),
                            ({"prompt": prompt, "suffix": "b", "max_tokens": 16}, "max_tokens"),
                            ({"prompt": prompt, "suffix": "b", "min_tokens": 16}, "min_tokens"),
                            ({"prompt": prompt, "template": "x<|hole:4|>" + "a " * 20}, "template"),
                            ({"prompt": "hi " * 12, "suffix": "b"}, "prompt"),
                            # a prompt that cannot heal (ids), a position short of one canvas: the prompt, whatever
                            # limit is sent (counted as if its last token healed, it named them)
                            ({"prompt": list(range(5, 38)), "suffix": "b", "max_tokens": 32}, "prompt"),
                            ({"prompt": list(range(5, 38)), "suffix": "b", "min_tokens": 20}, "prompt")):
            r = post(**body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_a_suffix_after_a_prompt_whose_space_heals_into_the_hole_fits_by_its_healed_length():
    """A text prompt's trailing space moves into a suffix request's hole: the prompt was measured against the context
    before it moved (a 400 naming the prompt for a request that fits exactly), and the default cut beside the
    suffix must count the moved space with the suffix's tokens."""
    from fastapi.testclient import TestClient

    lm = load_model("blockpress-code", "float32", "cpu")
    lm.generation_config = {**lm.generation_config, "max_denoising_steps": 2}
    prompt = "def area(r):\n    return "
    ids, c = lm.tokenizer.encode_prompt(prompt), lm.config.canvas_length
    assert lm.tokenizer.token_texts()[ids[-1]] == " "  # (the space is a token of its own, which heals)
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_context=len(ids) - 1 + c)) as http:
        answers = [http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "suffix": "\n", "seed": 0,
                                                       **extra}) for extra in ({}, {"max_tokens": c - 2})]
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert answers[0].json()["choices"] == answers[1].json()["choices"]  # the default cut to the 30 that fit


def test_stop_strings_past_the_servers_limit_are_a_400_naming_stop(server):
    """Each stop string is searched for in every row's text at every canvas, on the engine thread that serves every
    client: a request listing a million (5 MB of JSON, within the body limit) held it for seconds a canvas, and was
    answered 200. Past max_stops (16 by default) a request is refused naming `stop`; at it, it is answered."""
    url = server[0] + "/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "max_denoising_steps": 1}
    r = httpx.post(url, json={**body, "stop": ["never"] * 17}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stop" and err["message"] == ("stop: 17 stop strings are more than the 16 this server "
                                                         "takes (serve's --max-stops)")
    assert httpx.post(url, json={**body, "stop": ["never"] * 16}, timeout=30).status_code == 200


def test_a_default_of_more_denoising_steps_than_a_request_may_ask_for_is_refused_at_start():
    """A checkpoint's generation_config.json of max_denoising_steps 10**9 was served: every request that sent none
    ran that many forward passes a canvas (an 8-token canvas of the tiny model took 70 s at 256 steps), holding the
    engine thread every client shares, where a request's own is refused past 1024."""
    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 10**9}
    with pytest.raises(ValueError, match=r"^serve: the model's default max_denoising_steps \(1000000000, its "
                                         r"generation_config.json's\) is more than the 1024 a request may ask for"):
        create_app(lm, MODEL)
    lm.generation_config = {"max_denoising_steps": 1024}  # the limit itself is served
    create_app(lm, MODEL)


def test_a_body_over_the_limit_is_a_413_before_it_is_read():
    """Any body was read whole and JSON-parsed before a check: a 200 MB prompt took 3.5 s and 300 MB of memory
    for the 400 its length got. One whose Content-Length passes the limit is refused unread, and a chunked one as
    soon as it does, in OpenAI's error shape; a body within the limit is answered as before."""
    from fastapi.testclient import TestClient

    from blockpress.serve import BodyLimit, body_limit

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 8}
    with pytest.raises(ValueError, match="max_body_bytes: expected a positive integer"):
        create_app(lm, MODEL, max_body_bytes=0)
    # the default leaves room for the longest text the context could take, JSON-escaped at its widest
    assert body_limit(4096, 64) == 4096 * 64 * 12 + 2**20
    read = []

    def body(size: int):  # a chunked body (no Content-Length), counting what the server took of it
        for _ in range(size // 1000):
            read.append(1000)
            yield b" " * 1000
        yield json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 4}).encode()

    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, max_body_bytes=5000)) as http:
        big = json.dumps({"model": MODEL, "prompt": "x" * 6000}).encode()
        r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert f"is {len(big)} bytes, more than the 5000 bytes" in r.json()["error"]["message"]
        r = http.post("/v1/completions", content=body(100_000), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "is more than the 5000 bytes" in r.json()["error"]["message"], r.text
        read.clear()
        r = http.post("/v1/completions", content=body(3000), headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
        assert http.get("/health").status_code == 200
    # (the test client reads a chunked body whole before the app runs:) the limit stops keeping the client's chunks;
    # the rest is read and dropped up to drain_bytes (BodyLimit.drain), and a body declared longer is not read
    sent, taken = [], []

    async def receive():
        taken.append(1000)
        return {"type": "http.request", "body": b" " * 1000, "more_body": True}

    async def send(message):
        sent.append(message)

    async def app(*_):
        raise AssertionError("a body over the limit reached the app")

    # (with Expect: 100-continue a declared length is refused before any is read, so the client sends none; a chunked
    # body is read before it is refused, the 100 Continue already sent, so the rest comes and is drained)
    for headers, read in (([], 6000 + 21_000), ([(b"content-length", b"30000")], 0),
                          ([(b"content-length", b"6000"), (b"expect", b"100-continue")], 0),
                          ([(b"expect", b"100-continue")], 6000 + 21_000)):
        sent.clear()
        taken.clear()
        asyncio.run(BodyLimit(app, 5000, drain_bytes=20_000)(
            {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive, send))
        assert sent[0]["status"] == 413 and sum(taken) == read, (headers, sum(taken))


def test_a_body_of_exactly_the_limit_is_taken():
    """max_body_bytes is the most a body may hold: one of exactly that many bytes reaches the app, whether its
    Content-Length says so or it comes chunked; a byte more is a 413."""
    from blockpress.serve import BodyLimit

    def answer(size: int, headers: list) -> tuple[list, list]:  # (what the client was sent, the bodies the app got)
        chunks, sent, reached = [b"x" * 60, b"x" * (size - 60)], [], []

        async def receive():
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            reached.append((await receive())["body"])

        asyncio.run(BodyLimit(app, 100)({"type": "http", "method": "POST", "path": "/v1/completions",
                                         "headers": headers}, receive, send))
        return sent, reached

    for declared in (True, False):
        sent, reached = answer(100, [(b"content-length", b"100")] if declared else [])
        assert not sent and reached == [b"x" * 100], (declared, sent)
        sent, reached = answer(101, [(b"content-length", b"101")] if declared else [])
        assert sent[0]["status"] == 413 and not reached, declared


def test_a_refused_body_is_answered_not_reset():
    """A body refused by its length was left unread, and a connection closed with bytes unread is reset, which can
    destroy the 413 on its way: httpx's AsyncClient (the openai AsyncOpenAI client's) read a connection error for 44
    of 60 bodies of 3 MB, and the openai client sent each again twice. The rest of the body is read and dropped
    before the answer now."""
    lm = load_model("random-tiny", None, "cpu")
    base, srv = start_in_background(create_app(lm, MODEL, prefix_cache_bytes=0, max_body_bytes=100_000))
    big = json.dumps({"model": MODEL, "prompt": "x" * 3_000_000}).encode()

    async def post_all():
        async with httpx.AsyncClient(timeout=30) as http:
            return [(await http.post(base + "/v1/completions", content=big, headers={"content-type": "application/json"}))
                    .status_code for _ in range(8)]

    try:
        assert asyncio.run(post_all()) == [413] * 8
    finally:
        srv.should_exit = True


def test_a_chunked_body_over_the_limit_sent_after_100_continue_gets_its_413_whole():
    """curl sends a chunked body with `Expect: 100-continue`: the server read its first chunks (which sends `100
    Continue`), refused it past the limit, and skipped draining the rest for the Expect header, so the connection
    closed with bytes unread and was reset: the 413's headers came and its body did not (5 of 5 runs, 5 MiB)."""
    import socket

    lm = load_model("random-tiny", None, "cpu")
    base, srv = start_in_background(create_app(lm, MODEL, prefix_cache_bytes=0, max_body_bytes=100_000))
    host, port = base.removeprefix("http://").split(":")
    chunk = b"a" * 65536
    try:
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 100 Continue")
            for _ in range(32):  # 2 MiB, 20x the limit
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.sendall(b"0\r\n\r\n")
            answer = b""
            while data := conn.recv(65536):  # a reset raises here
                answer += data
    finally:
        srv.should_exit = True
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_body_that_stops_arriving_is_a_408():
    """A client that sent part of a body (or only its headers) and then nothing held its connection open for
    good: a few hundred such clients could take every file descriptor. Past the idle timeout it gets a 408 in
    OpenAI's error shape, and the connection is closed; a body that keeps coming in time is handed on whole."""
    from blockpress.serve import BodyLimit

    sent, reached = [], []

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        reached.append((await receive())["body"])

    def client(chunks):  # each chunk after its delay; None: nothing ever comes
        async def receive():
            delay, body = chunks.pop(0)
            await asyncio.sleep(3600 if delay is None else delay)
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}
        return receive

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    # a timeout well above the 0.1 s gaps below: a busy machine can wake the event loop late
    asyncio.run(BodyLimit(app, 5000, idle_timeout=0.6)(scope, client([(0, b"{"), (None, b"}")]), send))
    assert sent[0]["status"] == 408 and not reached
    headers = dict(sent[0]["headers"])
    assert headers[b"connection"] == b"close"
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_timeout" and "nothing came for 0.6 s" in error["message"]
    sent.clear()
    asyncio.run(BodyLimit(app, 5000, idle_timeout=0.6)(scope, client([(0.1, b"{"), (0.1, b"}")]), send))
    assert reached == [b"{}"] and not sent  # slow, but each chunk within the timeout


def test_a_body_that_trickles_in_is_a_408_at_its_deadline():
    """The idle timeout restarted at every byte, so a client that sent a Content-Length and then a byte every 59 s
    held its connection for good. The whole body now has a deadline too, as the header has: past it a 408 that says
    so, the connection closed, and nothing handed on."""
    from blockpress.serve import BodyLimit

    sent, reached = [], []

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        reached.append(await receive())

    async def trickle():  # a byte every 0.1 s, well within the idle timeout, and never the end
        await asyncio.sleep(0.1)
        return {"type": "http.request", "body": b" ", "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    started = time.monotonic()
    asyncio.run(BodyLimit(app, 5000, idle_timeout=0.6, body_timeout=1.0)(scope, trickle, send))
    assert time.monotonic() - started < 2.5 and not reached
    assert sent[0]["status"] == 408 and dict(sent[0]["headers"])[b"connection"] == b"close"
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_timeout" and "did not arrive whole within 1 s" in error["message"], error
    # a refused body's drain keeps the same deadline: a trickle past the limit is not read for good either
    sent.clear()
    started = time.monotonic()
    asyncio.run(BodyLimit(app, 0, idle_timeout=0.6, body_timeout=1.0)(scope, trickle, send))
    assert time.monotonic() - started < 2.5 and sent[0]["status"] == 413 and not reached
    # a second more for each 32 KiB of its Content-Length (a large body on a slow link), not of the limit: a 20-byte
    # trickle under a 64 MiB --max-body-bytes had 2,048 s
    sent.clear()
    started = time.monotonic()
    scope = {**scope, "headers": [(b"content-length", str(64 << 10).encode())]}
    asyncio.run(BodyLimit(app, 64 << 20, idle_timeout=0.6, body_timeout=1.0)(scope, trickle, send))
    assert 2.5 < time.monotonic() - started < 4.5 and sent[0]["status"] == 408, time.monotonic() - started
    assert "did not arrive whole within 3 s" in json.loads(sent[1]["body"])["error"]["message"]


def test_headers_that_do_not_arrive_in_time_are_a_408():
    """uvicorn timed nothing before a first response and reset its keep-alive timer on every byte, so a client
    that connected and sent nothing, half a request line, or a header byte now and then held a file descriptor
    for good. Now the line and headers must arrive whole within the deadline (from the connection, or from the
    next request's first byte on a kept-alive one): past it a 408 in OpenAI's error shape, and the connection closed."""
    import socket

    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True}

    base, srv = start_in_background(app, header_timeout=0.5)
    port = int(base.rsplit(":", 1)[1])

    def talk(parts, gap=0.0):  # what the server sent back until it closed, or 3 s
        with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
            for part in parts:
                with contextlib.suppress(OSError):  # the server may have closed already
                    conn.sendall(part)
                time.sleep(gap)
            start, data = time.perf_counter(), b""
            with contextlib.suppress(TimeoutError):
                while chunk := conn.recv(65536):
                    data += chunk
            return data, time.perf_counter() - start

    try:
        request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        for parts, gap in (([], 0), ([b"GET /hea"], 0), ([request[i:i + 3] for i in range(0, 27, 3)], 0.1)):
            data, waited = talk(parts, gap)  # nothing / half a line / trickled past the deadline
            assert data.startswith(b"HTTP/1.1 408 ") and waited < 2.5, (parts, data)
            error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_timeout" and "within 0.5 s" in error["message"]
        data, _ = talk([request[:20], request[20:]], 0.2)  # slow, but whole in time: answered; then idle, kept
        assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.1") == 1  # alive, with no 408
        data, _ = talk([request, b"GET /hea"], 0.2)  # a second request that stalls after the first's answer
        assert data.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in data
        data, _ = talk([request + request])  # pipelined: both answered, no 408
        assert data.count(b"HTTP/1.1 200 ") == 2 and b" 408 " not in data
    finally:
        srv.should_exit = True


def test_prompts_are_tokenized_off_the_event_loop(monkeypatch):
    """The handlers tokenized on the event loop, which serves every other client: a 240 KB prompt held /health
    and every stream in flight for the whole encode (~0.25 s). A completion's prompt, suffix and template and a
    chat's rendered messages are encoded in a worker thread."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 8}
    on_loop = []
    encode = lm.tokenizer.encode

    def spy(text, *a, **k):
        try:
            asyncio.get_running_loop()
            on_loop.append(text)
        except RuntimeError:  # no loop runs in this thread
            pass
        return encode(text, *a, **k)

    monkeypatch.setattr(lm.tokenizer, "encode", spy)
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:
        for route, body in (("completions", {"prompt": "def f(x):", "max_tokens": 4}),
                            ("completions", {"prompt": ["a", "b"], "suffix": "\nprint(f(2))", "max_tokens": 4}),
                            ("completions", {"prompt": "x = ", "template": "<|hole:2|> + 1\n", "max_tokens": 4}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})):
            r = http.post(f"/v1/{route}", json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
    assert on_loop == []


def test_errors_about_the_answers_length_name_max_completion_tokens_where_the_request_sent_it():
    """Chat's max_completion_tokens (the openai client's current name) past the context was a 400 naming max_tokens,
    a field the request never sent; so was a min_tokens above it."""
    from fastapi.testclient import TestClient

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(load_model("random-tiny", None, "cpu"), MODEL, prefix_cache_bytes=0,
                               max_context=40)) as http:
        for body, param, says in (
                ({"max_completion_tokens": 40}, "max_completion_tokens", "prompt tokens + max_completion_tokens 40"),
                ({"max_completion_tokens": 3, "min_tokens": 5}, "min_tokens", "is more than max_completion_tokens 3"),
                ({"max_tokens": 40}, "max_tokens", "prompt tokens + max_tokens 40")):
            err = http.post("/v1/chat/completions", json={**chat, **body}).json()["error"]
            assert err["param"] == param and says in err["message"], err


def test_max_completion_tokens_wins_over_max_tokens(server):
    """A chat request that sends both takes max_completion_tokens, OpenAI's current name (as vLLM does, and as the
    server's own errors name it), not the deprecated max_tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 1, "min_tokens": 5,
            "max_completion_tokens": 5, "max_tokens": 3}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text


def test_a_web_page_on_an_allowed_origin_can_call_the_api():
    """A browser front end on another origin (a dev server on another port) could not call the server at all: its
    preflight OPTIONS got a 405, and no answer carried Access-Control-Allow-Origin. allowed_origins (serve's
    --allowed-origins) lets the pages of the origins named call it, streams included; other origins, and every
    origin by default, get no CORS headers. A stream says Cache-Control: no-cache and X-Accel-Buffering: no (nginx
    in front of a front end held every chunk until the answer's end)."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    page, other = "http://localhost:3000", "https://evil.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,x-stainless-os"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "seed": 1}
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, allowed_origins=[page])) as http:
        r = http.options("/v1/chat/completions", headers={"Origin": page, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page, r.text
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "x-stainless-os" in r.headers["access-control-allow-headers"].lower()
        for stream in (False, True):
            r = http.post("/v1/completions", json={**body, "stream": stream}, headers={"Origin": page})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        # a stream is neither cached nor held by a proxy in between (nginx buffers a response unless told not to)
        assert (r.headers["cache-control"], r.headers["x-accel-buffering"]) == ("no-cache", "no")
        r = http.post("/v1/completions", json={**body, "model": "nope"}, headers={"Origin": page})  # errors too
        assert r.status_code == 404 and r.headers["access-control-allow-origin"] == page
        r = http.options("/v1/chat/completions", headers={"Origin": other, **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:  # by default no page may
        r = http.options("/v1/chat/completions", headers={"Origin": page, **preflight})
        assert "access-control-allow-origin" not in r.headers
        # a POST that needs no preflight is refused, not only hidden (a JSON one is preflighted, which CORS refuses)
        r = http.post("/v1/completions", content=json.dumps(body), headers={"Origin": page, "Content-Type": "text/plain"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, allowed_origins=["*"])) as http:
        r = http.options("/v1/completions", headers={"Origin": other, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    for bad in ("http://localhost:3000/", "localhost:3000", "http://x.example/app"):  # would never match a browser's
        with pytest.raises(ValueError, match=rf"^allowed_origins: '{bad}' is not an origin; expected scheme://host"):
            create_app(lm, MODEL, allowed_origins=[bad])


def test_a_page_on_an_origin_not_allowed_cannot_drive_the_model():
    """CORS hid the answer from a page on another origin but let its request run: a no-cors fetch with a Blob body
    sends no Content-Type and needs no preflight, and FastAPI before 0.132 parsed such a body as JSON, so any page the
    user visited could start generations. Now a POST that needs no preflight (no Content-Type, or a form's or
    text/plain) whose Origin is neither allowed nor the server's own gets a 403 before it is read; one from the
    server's own origin, or without Origin, is served. A JSON POST is preflighted, which CORS answers: one that
    reaches the server comes from a page CORS let through, or the server's own behind a proxy that rewrote Host
    (nginx's default), which was refused."""
    from fastapi.testclient import TestClient

    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2, "seed": 1}).encode()
    json_type = {"Content-Type": "application/json"}
    with TestClient(create_app(load_model("random-tiny", None, "cpu"), MODEL, prefix_cache_bytes=0,
                               allowed_origins=["http://localhost:3000"])) as http:
        simple = ({}, {"Content-Type": "text/plain;charset=UTF-8"}, {"Content-Type": "application/x-www-form-urlencoded"})
        for headers in simple:  # the Blob's POST has no Content-Type
            r = http.post("/v1/completions", content=body, headers={"Origin": "https://evil.example", **headers})
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers, r.text
            error = r.json()["error"]
            assert error["code"] == "origin_not_allowed" and "'https://evil.example'" in error["message"], error
            assert "--allowed-origins" in error["message"]
        # the server's own origin (TestClient's Host is testserver; over https behind a TLS proxy too), an allowed
        # one, and a client with no Origin pass
        for origin in ({"Origin": "http://testserver"}, {"Origin": "https://testserver"}, {"Origin": "http://localhost:3000"},
                       {}):
            r = http.post("/v1/completions", content=body, headers={**json_type, **origin})
            assert r.status_code == 200, (origin, r.text)
        r = http.post("/v1/completions", content=body, headers={"Origin": "https://testserver", **simple[1]})
        assert r.status_code != 403, r.text  # its own https page's text/plain body: about the body, not the origin
        # the page's own origin behind nginx, which sends Host: 127.0.0.1:8000 upstream: its JSON POST is served
        r = http.post("/v1/completions", content=body, headers={**json_type, "Origin": "https://chat.example.com",
                                                               "Host": "127.0.0.1:8000"})
        assert r.status_code == 200, r.text


def test_a_request_at_loopback_must_name_a_loopback_host(server):
    """DNS rebinding: a server on 127.0.0.1 answered any Host, so a page on evil.example whose name was then pointed
    at 127.0.0.1 was on the server's own origin and could drive the model and read its answers. At a loopback
    address only localhost, 127.0.0.1 and [::1] (any port) and the names allowed_hosts gives (serve's
    --allowed-hosts, for a reverse proxy) pass; another Host gets a 403 naming it. Elsewhere nothing is checked."""
    port = server[0].rpartition(":")[2]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LocalHost"):
        assert httpx.get(server[0] + "/v1/models", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", "localhost.evil.example", "127.0.0.1.evil.example"):
        r = httpx.get(server[0] + "/v1/models", headers={"Host": host})
        error = r.json()["error"]
        assert r.status_code == 403 and error["code"] == "host_not_allowed" and repr(host) in error["message"], r.text
        assert "--allowed-hosts" in error["message"]
    from blockpress.serve import RequireHost

    passed = []

    async def app(scope, receive, send):
        passed.append(scope["server"][0])

    async def send(message):
        pass

    def call(hosts, server, host):
        scope = {"type": "http", "path": "/v1/models", "server": (server, 8000), "headers": [(b"host", host)]}
        passed.clear()
        asyncio.run(RequireHost(app, hosts)(scope, None, send))
        return bool(passed)

    assert call(["api.example.com"], "127.0.0.1", b"API.example.com:443")  # a reverse proxy's name, any port
    assert call(["api.example.com"], "::ffff:127.0.0.1", b"localhost:8000")
    assert not call(["api.example.com"], "::ffff:127.0.0.1", b"evil.example")  # (a dual-stack socket's 127.0.0.1)
    assert not call([], "::1", b"evil.example") and call(["*"], "::1", b"evil.example")
    assert call([], "10.0.0.5", b"evil.example")  # beyond loopback: the API key's to guard
    # the URL `serve --host 0.0.0.0` (or ::, 127.0.0.2) prints, the machine's own name (Debian: 127.0.1.1) and a
    # fully qualified name's trailing dot: no domain an attacker could point here
    import socket

    for host in (b"0.0.0.0:8000", b"[::]:8000", b"127.0.0.2", b"192.168.1.5:8000", socket.gethostname().encode()):
        assert call([], "127.0.0.1", host), host
    assert call(["api.example.com"], "127.0.0.1", b"api.example.com.:8000")
    for bad in ("http://api.example.com", "api.example.com:443", "::1", "a b", "*.example.com", ".example.com",
                "api.example.com."):  # (a wildcard or a trailing dot never matched)
        with pytest.raises(ValueError, match=r"^allowed_hosts: .* is not a host name; expected a whole name as a Host"):
            create_app(server[1].state.engine.lm, MODEL, allowed_hosts=[bad])


def test_a_chat_request_s_tools_and_template_variables_are_checked_off_the_event_loop(monkeypatch):
    """A chat request's tools were dumped and its chat_template_kwargs checked (every text in them) on the event
    loop, while its messages went to a worker thread: a 3 MB request held every other client, /health included, for
    about 3 s. Both now run in a worker thread, where no event loop runs."""
    from fastapi.testclient import TestClient

    import blockpress.serve as serve

    on_loop = {}

    def running_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    def watched(name, run):
        def call(*args, **kwargs):
            on_loop[name] = running_loop()
            return run(*args, **kwargs)
        return call

    app = create_app(load_model("random-tiny", None, "cpu"), MODEL, prefix_cache_bytes=0)
    monkeypatch.setattr(serve, "template_variables", watched("template_variables", serve.template_variables))
    monkeypatch.setattr(serve.ChatRequest, "template_tools", watched("template_tools", serve.ChatRequest.template_tools))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with TestClient(app) as http:
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 1, "tools": [tool], "chat_template_kwargs": {"x": 1}})
    assert on_loop == {"template_variables": False, "template_tools": False}, on_loop


def test_more_messages_than_the_context_has_tokens_are_a_400(monkeypatch):
    """A conversation of more messages than the context could ever hold ran the chat template until its time limit
    (25 s for 150,000 one-character messages) and was answered 500 server_error, blamed on the template, which the
    openai client retries twice. It is now a 400 naming `messages` before any render (here a template given no time
    at all would fail any render it started)."""
    from fastapi.testclient import TestClient

    import blockpress.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 1e-9)
    messages = [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(41)]
    with TestClient(create_app(load_model("random-tiny", None, "cpu"), MODEL, prefix_cache_bytes=0,
                               max_context=40)) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and error["type"] == "invalid_request_error", r.text
    assert error["message"].startswith("messages: 41 messages cannot fit the context of 40 tokens"), error


def test_suffix_fills_exactly_max_tokens_before_it(client, server):
    """OpenAI's insert mode on the constrained canvas: the answer is max_tokens tokens that lead into the suffix,
    what the library's own template generation gives; streamed, it reassembles to the same text."""
    lm = server[1].state.engine.lm
    kw = dict(model=MODEL, prompt="def area(r):\n    return ", suffix="\n\nprint(area(2))\n", max_tokens=6, seed=4)
    r = client.completions.create(**kw)
    prompt = lm.tokenizer.encode(kw["prompt"], add_bos=lm.tokenizer.bos_id is not None)
    direct = lm.generate([prompt], template=[[-1] * 6 + lm.tokenizer.encode(kw["suffix"])], seeds=[4])
    assert r.choices[0].text == lm.tokenizer.decode(direct.new_tokens[0, :6].tolist())
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == r.choices[0].text


def test_a_suffix_fill_cut_at_a_stop_holding_a_replacement_character_counts_as_a_growing_row():
    """The tokens counted through a suffix fill's stop are found by bisection on "the first p tokens' text holds a
    stop", which a prefix ending inside a character broke: its trailing U+FFFD (the character's first bytes) matched
    a stop ending in U+FFFD that the next token took away, and the count stopped short (6 where a plain row, searched
    as it grows, counts 9). Checked against a token-by-token scan on every two-character U+FFFD stop of the fills."""
    from fastapi.testclient import TestClient

    from blockpress.generate import cut_at_stop

    lm = load_model("random-tiny", None, "cpu")
    tok = lm.tokenizer
    body = {"model": MODEL, "prompt": "x =", "suffix": "\ny\n", "max_tokens": 24, "max_denoising_steps": 2}
    checked = 0
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:
        for seed in range(4):
            out = lm.generate([tok.encode_prompt(body["prompt"])], template=[[-1] * 24 + tok.encode(body["suffix"])],
                              seeds=[seed], max_denoising_steps=2)
            hole, fill = out.new_tokens[0, :24].tolist(), out.fills[0][0]
            for stop in sorted({fill[a:a + 2] for a in range(len(fill) - 1) if "\ufffd" in fill[a:a + 2]})[:4]:
                texts = [tok.decode(hole[:p]) for p in range(25)]
                through = next((p for p in range(1, 25) if cut_at_stop(texts[p], [stop], growing=True) != texts[p]), 24)
                r = http.post("/v1/completions", json={**body, "seed": seed, "stop": [stop]}).json()
                assert r["choices"][0]["text"] == cut_at_stop(fill, [stop])
                assert r["usage"]["completion_tokens"] == through, (seed, stop)
                checked += 1
    assert checked >= 4


def test_a_suffix_fill_is_cut_at_its_first_stop_string():
    """FIM clients (Continue.dev's, for a diffusion LM) send stop strings beside a suffix, and got a 400 ("stop: not
    with suffix"), so no completion at all. The hole is still written whole (max_tokens long), and its fill is cut
    before its first stop string, with finish_reason "stop" and the tokens through the one that completes the stop
    counted, as a plain completion that stops; streamed, the chunks add up to that text (a tail that may begin a
    stop is held back) and the usage is the same."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    tok = lm.tokenizer
    # no trailing space in the prompt (none healed into the hole); 24 tokens span two 16-token canvases
    body = {"model": MODEL, "prompt": "def add(a, b):", "suffix": "\nprint(add(1, 2))\n", "max_tokens": 24,
            "max_denoising_steps": 3}

    def fill(seed):  # the library's answer: its hole's tokens and text
        out = lm.generate([tok.encode_prompt(body["prompt"])], template=[[-1] * 24 + tok.encode(body["suffix"])],
                          seeds=[seed], max_denoising_steps=3)
        return out.new_tokens[0, :24].tolist(), out.fills[0][0]

    # A stop string across the canvas edge (random-tiny writes a character a token here): the first canvas's text
    # ends with its start, which the stream holds back until the next canvas settles it.
    def across(text):
        stop = text[15:17]
        return "\ufffd" not in stop and text.find(stop) == 15 and len(text) == 24

    body["seed"] = next(seed for seed in range(5, 40) if across(fill(seed)[1]))
    hole, text = fill(body["seed"])
    stop = text[15:17]
    through = next(p for p in range(1, 25) if stop in tok.decode(hole[:p]))  # the token that completes it
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:
        r = http.post("/v1/completions", json={**body, "stop": ["\u2603\u2603", stop]})
        with http.stream("POST", "/v1/completions", json={**body, "stop": ["\u2603\u2603", stop], "stream": True,
                                                           "stream_options": {"include_usage": True}}) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        unstopped = http.post("/v1/completions", json={**body, "stop": "\u2603\u2603"}).json()
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["text"] == cut_at_stop(text, [stop]) == text[:15]
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == through < 24
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == answer["choices"][0]["text"] and texts[0] == text[:15]  # the stop's start held back
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"] == answer["usage"]
    # a stop string the fill does not hold leaves it whole: every hole token counts
    assert unstopped["choices"][0]["text"] == text and unstopped["usage"]["completion_tokens"] == 24


def test_an_empty_suffix_is_none(client):
    """A fill-in-the-middle client at a file's end sends suffix "": the answer was a canvas of exactly max_tokens
    that always said "stop", never a shorter completion. It is now a plain completion, stop strings and all."""
    kw = dict(model=MODEL, prompt="def area(r):\n    return ", max_tokens=12, seed=4)
    for extra in ({}, {"stop": ["\n"]}):
        empty, plain = (client.completions.create(**kw, **extra, **suffix) for suffix in ({"suffix": ""}, {}))
        # (the usage less what the prefix cache held: the second of the two reuses the first's prompt)
        assert (empty.choices[0].text, empty.choices[0].finish_reason,
                empty.usage.model_dump(exclude={"prompt_tokens_details"})) == \
               (plain.choices[0].text, plain.choices[0].finish_reason,
                plain.usage.model_dump(exclude={"prompt_tokens_details"}))


def test_template_answers_with_the_filled_text(client, server):
    lm = server[1].state.engine.lm
    kw = dict(model=MODEL, prompt="# a point\n", max_tokens=16, seed=9,
              extra_body={"template": "x = <|hole:3|>\ny = <|hole:2|>\n"})
    r = client.completions.create(**kw)
    text = r.choices[0].text
    assert text.startswith("x = ") and "\ny = " in text and text.endswith("\n")  # every fixed piece kept
    prompt = lm.tokenizer.encode(kw["prompt"], add_bos=lm.tokenizer.bos_id is not None)
    assert text == lm.generate([prompt], template=kw["extra_body"]["template"], seeds=[9]).texts[0]
    assert r.usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == text


@pytest.mark.parametrize("body, param", [
    ({"suffix": "b", "template": "<|hole|>"}, "template"),
    # a template's answer is the whole filled text, which a stop string would cut inside the client's own text
    ({"template": "<|hole|>", "stop": ["\n"]}, "stop"),
    ({"template": "<|hole|>", "token_healing": True}, "token_healing"),
    ({"template": "no holes here"}, "template"),
    ({"template": "a <|hole:0|> b"}, "template"),
    # Holes beyond max_tokens ran anyway: <|hole:99999|> held the engine for minutes.
    ({"template": "<|hole:2000|>", "max_tokens": 4}, "template"),
])
def test_bad_infill_requests(server, body, param):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "a", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("stop", ["", [], [""], ["", ""]])
def test_empty_stop_strings_are_none_beside_a_suffix(server, stop):
    """Empty stop strings are dropped as none; beside a suffix [""] was refused ("stop: not with suffix") where ""
    and [] were accepted."""
    body = {"model": MODEL, "prompt": "a", "suffix": "b", "max_tokens": 4, "seed": 1}
    r = httpx.post(server[0] + "/v1/completions", json={**body, "stop": stop}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == httpx.post(server[0] + "/v1/completions", json=body,
                                                        timeout=60).json()["choices"][0]["text"]


def prefer_eos_then_a(lm, monkeypatch):
    """Patch the model's head so that every canvas position prefers EOS, then the letter a."""
    eos, letter, original = lm._eos_ids()[0], lm.tokenizer.encode("a")[-1], lm.model.head

    def head(hidden):
        logits = original(hidden)
        logits[..., eos] += 50.0
        logits[..., letter] += 40.0
        return logits

    monkeypatch.setattr(lm.model, "head", head)


def test_a_chat_reply_is_never_empty_unless_asked(client, server, monkeypatch):
    """A model that puts its end-of-turn token first would answer with nothing: chat bans it at the first position
    by default (min_tokens 1); min_tokens=0 allows it again, and completions keep 0."""
    prefer_eos_then_a(server[1].state.engine.lm, monkeypatch)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=1)
    assert client.chat.completions.create(**kw).choices[0].message.content == "a"
    assert client.chat.completions.create(**kw, extra_body={"min_tokens": 0}).choices[0].message.content == ""
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=8, seed=1).choices[0].text == ""


def test_an_end_of_turn_written_as_the_last_token_allowed_is_a_stop_not_the_length(client, server, monkeypatch):
    """The reply "a" then the end of turn: with max_tokens 2 the end of turn is the last token allowed, and the
    model ended the reply itself (finish_reason "stop", as OpenAI reports it); with max_tokens 1 the length did."""
    prefer_eos_then_a(server[1].state.engine.lm, monkeypatch)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=1)
    for max_tokens, finish in ((2, "stop"), (1, "length")):
        r = client.chat.completions.create(max_tokens=max_tokens, **kw)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("a", finish), max_tokens
        assert r.usage.completion_tokens == max_tokens
        streamed = [c.choices[0] for c in client.chat.completions.create(stream=True, max_tokens=max_tokens, **kw)]
        assert streamed[-1].finish_reason == finish


def test_a_chat_reply_never_holds_its_stop_string_by_default(client, server, monkeypatch):
    """Chat's default minimum (one token) also held back a stop string that the first token holds, so a client
    that sent stop "\\n" got "\\n..." back. That default bans the end of turn alone: the stop ends the reply at once
    (empty, finish_reason "stop"), in the stream too; a min_tokens the client sends keeps vLLM's rule."""
    prefer_eos_then_a(server[1].state.engine.lm, monkeypatch)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=1, stop="a")
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("", "stop")
    streamed = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.delta.content or "" for c in streamed) == "" and streamed[-1].finish_reason == "stop"
    asked = client.chat.completions.create(**kw, extra_body={"min_tokens": 1}).choices[0]
    assert (asked.message.content, asked.finish_reason) == ("a", "stop")  # the stop inside min_tokens: not counted


def test_a_broken_chat_template_is_a_json_server_error(server, monkeypatch):
    """The checkpoint's template failing is the server's fault: a 500 in OpenAI's error layout, not a bare 500."""
    lm = server[1].state.engine.lm
    monkeypatch.setattr(lm.tokenizer, "chat_template", "{{ messages[0].nope.x }}")
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["message"].startswith("chat_template: rendering failed")


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f"}}]])
def test_a_chat_to_a_model_without_a_chat_template_is_a_400_naming_it(server, monkeypatch, tools):
    """A model with no chat template cannot render messages: that is the request's to change (send a prompt to
    /v1/completions), not a server failure; it answered 500 (and, with tools, a 400 blaming the messages)."""
    lm = server[1].state.engine.lm
    monkeypatch.setattr(lm.tokenizer, "chat_template", None)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **({"tools": tools} if tools else {})}
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "no chat template" in error["message"] and "/v1/completions" in error["message"]


def test_the_served_name_is_a_folders_name_or_the_id_as_given(tmp_path):
    from blockpress.cli.serve import served_name

    (tmp_path / "my-ckpt").mkdir()
    assert served_name(str(tmp_path / "my-ckpt") + "/") == "my-ckpt"
    # a cached hub model keeps its repo id, which clients send as `model`; a shipped name stays as it is
    assert served_name("google/diffusiongemma-26B-A4B-it") == "google/diffusiongemma-26B-A4B-it"
    assert served_name("blockpress-code") == "blockpress-code"


def test_the_served_name_of_a_lora_runs_adapter_folder_is_the_runs(tmp_path):
    """Every LoRA run's adapter folder is OUT/adapter: `serve --model OUT/adapter` served the id 'adapter' whatever
    the run, so the servers of two runs could not be told apart."""
    from blockpress.cli.serve import served_name

    adapter = tmp_path / "sql-lora" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    assert served_name(str(adapter)) == served_name(str(adapter) + "/") == "sql-lora"
    (tmp_path / "adapter").mkdir()  # a checkpoint folder that happens to be named so keeps its name
    (tmp_path / "adapter" / "config.json").write_text("{}")
    assert served_name(str(tmp_path / "adapter")) == "adapter"


def test_the_served_name_of_the_current_folder_is_its_name(tmp_path, monkeypatch):
    """`serve --model .` from inside the checkpoint folder served the id '' (Path('.').name), which /v1/models
    listed and every request had to send."""
    from blockpress.cli.serve import served_name

    (tmp_path / "my-ckpt" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "my-ckpt")
    assert served_name(".") == served_name("./") == served_name("sub/..") == "my-ckpt"
    monkeypatch.chdir(tmp_path / "my-ckpt" / "sub")
    assert served_name("..") == "my-ckpt"


def test_a_model_is_known_by_its_served_name_alone(tmp_path):
    """Under --served-name a request naming the checkpoint's folder was answered (its `model` saying the folder's name),
    while /v1/models listed only the served name and /v1/models/{folder} was a 404 saying the model does not exist."""
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2}
    lm.path = tmp_path / "tinyck"  # as loaded from that folder
    with TestClient(create_app(lm, "team/tiny", prefix_cache_bytes=0)) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["team/tiny"]
        for name, status in (("team/tiny", 200), ("tinyck", 404)):
            card = http.get(f"/v1/models/{name}")
            r = http.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2})
            assert card.status_code == r.status_code == status, (name, r.text)
        assert r.json()["error"]["message"] == "model 'tinyck' does not exist; this server has 'team/tiny'"
        assert card.json()["error"] == r.json()["error"]  # the model route's 404 says it in the same words
        assert http.post("/v1/completions", json={"model": "team/tiny", "prompt": "x", "max_tokens": 2}).json()[
            "model"] == "team/tiny"


def test_a_model_named_in_either_unicode_form_is_the_one_served_and_a_name_of_no_utf8_is_refused(tmp_path, capsys):
    """A macOS folder name is decomposed ("e" then its accent): a client typing it composed got "model 'modèle'
    does not exist; this server has 'modèle'". A folder named in another encoding (its bytes read as lone
    surrogates) made every answer naming the model a bare 500."""
    import os
    import unicodedata

    from fastapi.testclient import TestClient

    from blockpress.cli import main

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2}
    decomposed = unicodedata.normalize("NFD", "modèle-café")
    with TestClient(create_app(lm, decomposed, prefix_cache_bytes=0)) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["modèle-café"]
        for asked in ("modèle-café", decomposed):
            r = http.post("/v1/completions", json={"model": asked, "prompt": "x", "max_tokens": 2})
            assert r.status_code == http.get(f"/v1/models/{asked}").status_code == 200, r.text
    with pytest.raises(ValueError, match=r"model_name: not valid UTF-8"):
        create_app(lm, "mod\udce8le")
    folder = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"mod\xe8le"))
    os.mkdir(folder)
    assert main(["serve", "--model", folder, "--port", "0"]) == 2  # refused before the model loads
    err = capsys.readouterr().err
    assert "--model: the folder name 'mod\\udce8le': not valid UTF-8" in err and "--served-name" in err


def test_drafts_do_not_repeat_the_healed_prompt_token():
    """With token healing the first new tokens repeat the dropped prompt token's text ("\\n"); the answer drops
    it, and so must the drafts streamed before it (they started with it)."""
    lm = load_model("blockpress-code", None, "cpu")
    lm.generation_config = dict(lm.generation_config, max_denoising_steps=4)
    base, srv = start_in_background(create_app(lm, "code", prefix_cache_bytes=0))
    try:
        body = {"model": "code", "prompt": "def f(x):\n", "max_tokens": 16, "seed": 1, "stream": True, "drafts": True,
                "token_healing": True}
        drafts, text = [], ""
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "blockpress" in chunk:
                        drafts.append(chunk["blockpress"]["draft"])
                    else:
                        text += chunk["choices"][0]["text"] or ""
        assert drafts and text.startswith("    ") and not text.startswith("\n")
        assert all(d.startswith("    ") and not d.startswith("\n") for d in drafts), drafts[:2]
    finally:
        srv.should_exit = True


def test_the_engine_survives_a_failed_error_report_and_stops_with_the_app():
    """A batch that fails reports an error to each of its requests; when that report cannot be delivered (the
    request's event loop is gone) the engine thread used to die, and every later request hung."""
    from fastapi.testclient import TestClient

    class Gone:
        cancelled = __import__("threading").Event()
        alone = False  # (a Job's: see Engine._admit)
        request_id = "gone-1"  # (a Job's: the engine's log lines name it)

        def key(self):
            return ("gone",)

        def put(self, item):
            raise RuntimeError("Event loop is closed")

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    with TestClient(create_app(lm, MODEL)) as http:
        engine = http.app.state.engine
        with engine.lock:
            engine.waiting.append(Gone())  # its batch fails (no prompt), and so does the report
            engine.arrived.notify()
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert engine.thread.is_alive()
    engine.thread.join(10)
    assert not engine.thread.is_alive()  # the app's shutdown ended it


def test_a_job_that_cannot_start_a_batch_gets_an_error_and_the_engine_goes_on():
    """Starting a batch (Engine._admit) ran outside the guard that keeps the engine thread serving: a job whose batch
    could not be made ended the thread, and every later request waited forever. That job now gets an error."""
    from fastapi.testclient import TestClient

    told = []

    class Broken:
        cancelled = threading.Event()
        alone = False
        request_id = "broken-1"

        def key(self):
            raise TypeError("a defect in the job's settings")

        def put(self, item):
            told.append(item)

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    with TestClient(create_app(lm, MODEL)) as http:
        engine = http.app.state.engine
        with engine.lock:
            engine.waiting.append(Broken())
            engine.arrived.notify()
        deadline = time.monotonic() + 60  # (bounded: a request sent to a dead engine thread waits forever)
        while not told and engine.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert told and engine.thread.is_alive()
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert engine.thread.is_alive()
        assert [type(t).__name__ for t in told] == ["JobError"] and "a defect in the job's settings" in told[0].message
        assert not engine.waiting


def test_an_app_that_is_never_served_keeps_no_thread():
    """create_app started the engine thread at once and only the app's shutdown ended it: an app made and never
    served (a notebook cell run again, a script that failed before uvicorn ran it) left a thread waiting forever,
    holding the model (10 create_app calls: 10 threads). It starts with the app, or with the first request."""
    from fastapi.testclient import TestClient

    def engines():  # the engine threads alive; an earlier test's may end meanwhile, so only new ones count
        return {t for t in threading.enumerate() if t.name == "blockpress-engine"}

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    before = engines()
    for _ in range(3):
        create_app(lm, MODEL)
    assert not engines() - before
    app = create_app(lm, MODEL)
    engine = app.state.engine
    with TestClient(app) as http:  # served: the app's start starts it, its shutdown ends it
        assert engine.thread.is_alive()
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}).status_code == 200
    engine.thread.join(10)
    assert not engine.thread.is_alive() and not engines() - before
    # run without its lifespan (TestClient outside `with`): the first request starts it
    bare = create_app(lm, MODEL)
    r = TestClient(bare).post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200 and bare.state.engine.thread.is_alive()
    bare.state.engine.close()
    assert not bare.state.engine.thread.is_alive()


def test_an_app_that_is_gone_lets_go_of_its_model():
    """FastAPI keeps every endpoint function in a cache of the process (4096 of them), and the endpoints closed over
    the model: one served and shut down, or never served, kept its weights and prefix cache for the life of the
    process (3 blockpress-code apps served and stopped in turn: RSS 248 -> 445 MB)."""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    model, cache = weakref.ref(lm.model), None
    app = create_app(lm, MODEL, prefix_cache_bytes=1 << 20)
    with TestClient(app) as http:
        prompt = " ".join(["word"] * 40)  # long enough for the prefix cache to keep it
        for route, body in (("/v1/completions", {"prompt": prompt}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
            r = http.post(route, json={"model": MODEL, "max_tokens": 3, **body})
            assert r.status_code == 200, r.text
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        assert len(app.state.engine.prefix_cache) >= 1
        cache = weakref.ref(app.state.engine.prefix_cache)
    create_app(lm, MODEL)  # and one never served
    del lm, app, http, r
    gc.collect()
    assert model() is None and cache() is None


def test_an_app_mounted_in_a_host_app_closes_its_engine_when_the_host_goes():
    """Starlette runs no mounted app's lifespan: under host.mount("/llm", create_app(lm)) the first request started
    the engine thread and nothing ended it, so after the host app's whole lifespan the thread still ran and held the
    model (a notebook cell run again kept one more model a run). The engine closes when its app is collected."""
    import gc
    import weakref

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    model = weakref.ref(lm.model)
    host, app = FastAPI(), create_app(lm, MODEL)
    host.mount("/llm", app)
    with TestClient(host) as http:  # the host's lifespan, start to end
        r = http.post("/llm/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 200, r.text
    thread = app.state.engine.thread
    assert thread.is_alive()  # (the sub-app's lifespan never ran)
    del lm, host, app, http, r
    gc.collect()
    assert not thread.is_alive() and model() is None


def test_an_answered_choice_of_n_gives_its_batch_place_to_a_waiting_request():
    """A choice of an n>1 request that ended stays in its batch until the request's last choice ends (it is released
    with the request), and was counted as running: a waiting request did not start, though serving.md says an ended
    row's place goes to one (/health and /metrics counted it too). An answered row holds no place."""
    import threading
    from types import SimpleNamespace

    app = create_app(load_model("random-tiny", None, "cpu"), MODEL, max_batch=2, prefix_cache_bytes=0)
    engine = app.state.engine
    jobs = [SimpleNamespace(cancelled=threading.Event()) for _ in range(3)]
    jobs[2].cancelled.set()  # a client that left
    engine.batches = [SimpleNamespace(jobs=jobs, answered=[True, False, False])]
    try:
        assert engine.running() == 1
    finally:
        engine.batches = []


def test_latency_histogram_is_cumulative():
    from blockpress.serve import Metrics

    m = Metrics()
    for s in (0.01, 0.3, 0.3, 7.0, 100.0):
        m.observe(s)
    text = m.render({})
    assert 'le="0.05"} 1\n' in text and 'le="0.5"} 3\n' in text and 'le="10"} 4\n' in text
    assert 'le="+Inf"} 5\n' in text and "blockpress_request_seconds_count 5\n" in text
    assert "blockpress_request_seconds_sum 107.61" in text


def test_a_latency_on_a_buckets_bound_counts_in_that_bucket():
    """Prometheus's `le` is "less than or equal": an observation of exactly a bucket's bound is in that bucket."""
    from blockpress.serve import Metrics

    m = Metrics()
    for s in (0.05, 0.5, 10):
        m.observe(s)
    text = m.render({})
    assert 'le="0.05"} 1\n' in text and 'le="0.5"} 2\n' in text and 'le="10"} 3\n' in text, text


def test_null_max_new_tokens_in_generation_config_means_the_default(server):
    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_new_tokens": None, "max_denoising_steps": 2}
    assert lm.default_max_new_tokens == 256
    lm.generation_config = {"max_new_tokens": "64"}
    with pytest.raises(ValueError, match="generation_config max_new_tokens"):
        lm.generate([3, 4])
    for zero in ({"t_min": 0}, {"t_min": 0, "t_max": 0}):  # was refused: t_max "should be greater than 0"
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **zero})
        assert r.status_code == 200, r.text  # 0 is a valid schedule end (and start), as in SamplerConfig


def test_openai_clients_message_shapes(server):
    """Current SDKs send content as a list of text parts and call the system role "developer"."""
    def chat(messages, **kw):
        return httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": messages, "max_tokens": 4, "seed": 3, **kw})

    # the parts' texts one line apart, as vLLM joins them
    plain = chat([{"role": "system", "content": "be\nbrief"}, {"role": "user", "content": "hi there"}])
    parts = chat([{"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
                  {"role": "user", "content": [{"type": "text", "text": "hi there"}]}])
    assert plain.status_code == parts.status_code == 200
    assert parts.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    image = chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert image.status_code == 400 and image.json()["error"]["param"] == "messages[0].content"


def test_a_text_parts_cache_control_is_a_label(server, monkeypatch):
    """litellm's openai/ provider passes Anthropic's prompt-caching hint through inside a text part
    ({"type": "text", "text": ..., "cache_control": {"type": "ephemeral"}}): a 400 "Extra inputs are not permitted".
    It asks for nothing this server does, so it is taken as a label, as prompt_cache_key is, and the chat template
    never sees it: the parts render as they do without it."""
    import blockpress.serve as serve

    rendered = []
    original = serve.chat_message
    monkeypatch.setattr(serve, "chat_message",
                        lambda message, i, **kw: rendered.append(message) or original(message, i, **kw))

    def chat(hint):
        return httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "seed": 3, "messages": [
                {"role": "system", "content": [{"type": "text", "text": "be brief", **hint}]},
                {"role": "user", "content": [{"type": "text", "text": "hi", **hint}]}]})

    plain, hinted = chat({}), chat({"cache_control": {"type": "ephemeral"}})
    assert plain.status_code == hinted.status_code == 200, hinted.text
    assert hinted.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert len(rendered) == 4 and rendered[2:] == rendered[:2]  # the template's messages, hint or none
    bad = chat({"cache_control": "ephemeral"})  # a hint is an object, as Anthropic's is
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content", bad.text


def test_a_reply_sent_back_as_the_openai_clients_model_dump_writes_it_is_taken(client):
    """An agent loop that appends `reply.choices[0].message.model_dump()` sends the rest of the SDK's reply object
    too, each null (refusal, annotations, audio, function_call): its second turn was a 400 naming an unknown field
    'messages[1].refusal'. Null asks for nothing, so it reads as the message object itself; a value that would ask
    for something is refused by name."""
    first = [{"role": "user", "content": "hi"}]
    message = client.chat.completions.create(model=MODEL, messages=first, max_tokens=4, seed=1).choices[0].message
    dumped = message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()

    def turn(sent):
        return client.chat.completions.create(model=MODEL, messages=[*first, sent, {"role": "user", "content": "and?"}],
                                              max_tokens=4, seed=2)

    a, b = turn(message), turn(dumped)
    assert (b.choices[0].message.content, b.usage.prompt_tokens) == (a.choices[0].message.content, a.usage.prompt_tokens)
    for name, value in (("refusal", "I cannot."), ("annotations", [{"type": "url_citation"}]),
                        ("function_call", {"name": "f", "arguments": "{}"})):
        with pytest.raises(openai.BadRequestError) as refused:
            turn({**dumped, name: value})
        assert refused.value.body["param"] == f"messages[1].{name}", refused.value.body


def test_empty_prompt_and_full_queue_say_so(server):
    """An empty text is a prompt of BOS alone, as lm.generate("") and `blockpress generate ""` take it (the server
    alone refused it): the same answer and usage as BOS's id sent; no prompt, or one of no ids, is refused."""
    bos = server[1].state.engine.lm.tokenizer.bos_id
    answers = [httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                               "seed": 5}, timeout=30).json() for prompt in ("", [bos])]
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"] == 1
    for prompt, name in (([], "prompt"), ([[]], "prompt[0]")):
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"] == f"{name}: must not be empty"
    with queue_of(server[1].state.engine, 1, waiting=1):
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    text = httpx.get(server[0] + "/metrics").text
    assert "# TYPE blockpress_request_seconds histogram" in text and "# TYPE blockpress_requests_total counter" in text
    assert "# TYPE blockpress_queue_depth gauge" in text


def test_max_length_in_the_generation_config_bounds_a_request_without_max_tokens():
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_length": 12, "max_denoising_steps": 2}
    with TestClient(create_app(lm, MODEL)) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "min_tokens": 1, "seed": 0})
        usage = r.json()["usage"]
        assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 12
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab " * 20})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "max_length" in r.text
        assert r.json()["error"]["message"].endswith("; send max_tokens") and "max_new_tokens" not in r.text
        # Where max_length leaves nothing, a min_tokens is the length, as lm.generate's min_new_tokens is (a 400
        # named a max_tokens the client never sent)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab " * 20, "min_tokens": 3, "seed": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        # not chat's own minimum of 1 (it bans an empty reply; no client asked for one token), nor beside a template,
        # whose length is its own
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "ab " * 20}]})
        assert r.status_code == 400 and "max_length" in r.text and r.json()["error"]["param"] == "messages", r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab " * 20, "min_tokens": 3,
                                               "template": "x<|hole:2|>"})
        assert r.status_code == 400 and "max_length" in r.text and "max_tokens 0" not in r.text, r.text


def test_a_streamed_template_adds_up_to_the_plain_answer_special_tokens_included():
    """The stream decoded a template's text as generated text (special tokens dropped), the final answer kept the
    ones the template fixed: the chunks did not add up. Usage counts the healed space as written."""
    from fastapi.testclient import TestClient

    lm = load_model("blockpress-code", "float32", "cpu")
    body = {"model": MODEL, "prompt": "# x\n", "template": "a<eos> <|hole:3|>b\nc = <|hole:1|>\n", "temperature": 0,
            "max_denoising_steps": 4}
    with TestClient(create_app(lm, MODEL)) as http:
        plain = http.post("/v1/completions", json=body).json()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    text = plain["choices"][0]["text"]
    assert text.startswith("a<eos> ") and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert plain["usage"]["completion_tokens"] == 4  # the two holes: 3 + 1 tokens, each healed space among them
    app = create_app(lm, MODEL)
    with TestClient(app):
        pass
    with TestClient(app) as http:  # the engine ended with the first lifespan: a clear 503, not a request that hangs
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503


def _threaded_server(grace: float | None):
    """blockpress serve's server class on random-tiny (one request at a time, 8 steps a canvas) in a thread:
    (server, its thread, base URL), started."""
    from blockpress.cli.serve import _server_class

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 8}
    app = create_app(lm, MODEL, max_batch=1)
    srv = _server_class()(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                         timeout_graceful_shutdown=grace))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started or not thread.is_alive(), "the server to start")
    assert srv.started, "the server's thread ended without serving (its error is above)"
    return srv, thread, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


def test_a_shutdown_cuts_requests_in_flight_with_a_503_and_stops_the_engine():
    """A stop signal's grace period running out cancelled the handlers: a non-streamed request got a bare plain-text
    500, nothing told the engine, which kept generating for nobody until the exit aborted (rc 134); a stream just
    ended, looking like a short answer. Now every queued or running request is cut with an OpenAI-style 503 (a
    stream: an error event, no [DONE]) and the engine thread stops within a step."""
    srv, thread, base = _threaded_server(grace=0.2)  # one request runs, the other waits in the queue
    engine = srv.config.app.state.engine
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "min_tokens": 2000, "seed": 1}  # many seconds

    def plain():
        return httpx.post(base + "/v1/completions", json=body, timeout=120)

    def streamed():
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            return [x[6:] for x in r.iter_lines() if x.startswith("data: ")]

    with cf.ThreadPoolExecutor(2) as pool:
        answer = pool.submit(plain)
        wait_until(lambda: engine.metrics.counters["batches_total"], "the plain request to generate", [answer])
        stream = pool.submit(streamed)
        wait_until(lambda: engine.depth() >= 1, "the streamed request to queue behind it", [answer, stream])
        srv.should_exit = True
        r, lines = answer.result(), stream.result()
    assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down", r.text
    # the server's failure, not the client's: its type is OpenAI's server_error, as the plain request's 503 has it
    assert lines and json.loads(lines[-1])["error"] == {
        "message": "the server is shutting down", "type": "server_error", "param": None, "code": None}, lines[-1]
    assert "[DONE]" not in lines
    thread.join(30)
    assert not thread.is_alive() and not engine.thread.is_alive()
    counters = engine.metrics.counters
    assert counters["completion_tokens_total"] < 2000  # neither ran to its end (the cut one's canvases count)
    assert (counters["failed_total"], counters["cancelled_total"], counters["requests_total"]) == (2, 0, 0)


def test_a_server_without_a_grace_limit_shuts_down_and_stops_the_engine():
    """uvicorn's default timeout_graceful_shutdown, None, waits for requests in flight without a limit: the server
    class scheduled the engine's cut after None seconds, and its shutdown failed there with a TypeError, so the app's
    shutdown never ran and the engine thread was left running."""
    srv, thread, _ = _threaded_server(grace=None)
    engine = srv.config.app.state.engine
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive() and not engine.thread.is_alive()


EXIT_IN_FLIGHT = """
import threading, time, httpx, torch
torch.set_num_threads(1)
from blockpress.cli.common import load_model
import blockpress.serve as serve
from blockpress.serve import create_app, start_in_background
advance = serve.Batch.advance
def slow(batch):  # a canvas of a real model's length: the exit meets the engine mid-canvas
    time.sleep(0.3)
    return advance(batch)
serve.Batch.advance = slow
app = create_app(load_model("random-tiny", None, "cpu"), "tiny")
base, server = start_in_background(app)
body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "min_tokens": 4000}  # many seconds
threading.Thread(target=httpx.post, args=(base + "/v1/completions",), kwargs={"json": body, "timeout": 120},
                 daemon=True).start()  # a client still waiting when the script ends
deadline = time.monotonic() + 30
while not app.state.engine.running() and time.monotonic() < deadline:
    time.sleep(0.01)
server.should_exit = True
print("generating:", app.state.engine.running(), flush=True)
"""


def test_a_script_that_ends_while_a_request_is_generated_exits_cleanly():
    """A script that served with start_in_background, stopped it as its docstring says and ended while a request
    was in flight aborted (SIGABRT, "terminate called without an active exception"): uvicorn's shutdown waits for the
    request before the app's lifespan closes the engine, the server's daemon thread is never joined, and the
    interpreter finalised with the engine thread inside torch. Live engines are closed at exit. With canvases of a
    real model's length the app's shutdown then printed a traceback ("cannot schedule new futures after shutdown":
    its to_thread met an executor the exit had closed); it closes the engine in its own thread there."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EXIT_IN_FLIGHT], capture_output=True, text=True, timeout=120)
    assert done.stdout == "generating: 1\n", (done.stdout, done.stderr[-2000:])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_start_in_background_serves_a_host_app_that_mounts_blockpress_without_a_health_route():
    """start_in_background took only a 200 at /health: a host app that mounts blockpress under a path has none, so
    it waited out its whole timeout, then said "the server did not come up" while the server it started served."""
    from fastapi import FastAPI

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    host = FastAPI()
    host.mount("/llm", create_app(lm, MODEL))
    base, srv = start_in_background(host, timeout=5)
    try:
        assert httpx.get(base + "/health").status_code == 404  # (the host's own routes: none)
        r = httpx.post(base + "/llm/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        srv.should_exit = True


# uvicorn ends its thread with SystemExit(3) on a failed startup, which threading passes over and pytest reports
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_start_in_background_says_at_once_that_a_startup_failed_and_stops_a_server_that_is_late():
    """An app whose startup failed was waited out for the whole timeout (its thread had ended), then called "not
    up"; one that came up past the timeout was left serving, with nothing returned to stop it."""
    from fastapi import FastAPI

    @contextlib.asynccontextmanager
    async def failing(_):
        raise OSError("no such device")
        yield

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="stopped before it came up; its error is logged above"):
        start_in_background(FastAPI(lifespan=failing), timeout=20)
    assert time.perf_counter() - start < 5

    go, stopped = threading.Event(), threading.Event()

    @contextlib.asynccontextmanager
    async def late(_):
        await asyncio.to_thread(go.wait, 30)  # comes up once the test lets it, past start_in_background's timeout
        yield
        stopped.set()  # (the app's shutdown)

    with pytest.raises(RuntimeError, match=r"did not come up on .* within 0.1 s; it is stopped"):
        start_in_background(FastAPI(lifespan=late), timeout=0.1)
    go.set()
    assert stopped.wait(5), "the server that came up late is still serving"

@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_second_stop_signal_cuts_requests_in_flight_now(signum):
    """The startup line says "signal again to stop now": a second SIGTERM (docker stop, systemd) did nothing, the
    requests in flight ran out the whole grace period; a second Ctrl-C forced uvicorn's exit past the app's
    shutdown, so a plain request got a bare text 500, the engine thread was left inside torch and the process
    aborted (rc 134). Now either cuts what is in flight at once with the grace period's 503, and the engine stops."""
    import signal

    srv, thread, base = _threaded_server(grace=60)  # far longer than the test waits
    engine = srv.config.app.state.engine
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "min_tokens": 2000, "seed": 1}  # many seconds
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=15)
        wait_until(lambda: engine.metrics.counters["batches_total"], "the request to generate", [answer])
        start = time.perf_counter()
        for _ in range(2):  # as the signal handler calls it, twice
            srv.handle_exit(getattr(signal, signum), None)
        r = answer.result()
    assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down", r.text
    thread.join(15)
    assert not thread.is_alive() and not engine.thread.is_alive()
    assert time.perf_counter() - start < 10
    assert srv.force_exit is False  # the app's shutdown ran (it joined the engine thread)


def test_a_second_stop_signal_ends_the_requests_not_in_the_engine_too():
    """A second stop signal cut only the engine's jobs: uvicorn's shutdown still waited out the whole grace period
    for a connection whose body was still arriving, then cancelled it with an "Exception in ASGI application"
    traceback. Now the requests still running a moment after the cut are cancelled too, and one not yet in the
    engine gets the same 503 in OpenAI's shape."""
    import signal

    srv, thread, base = _threaded_server(grace=60)  # far longer than the test waits
    engine = srv.config.app.state.engine
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=15) as trickling:
        trickling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{")  # a body still arriving: no engine job
        time.sleep(0.3)
        start = time.perf_counter()
        for _ in range(2):  # as the signal handler calls it, twice
            srv.handle_exit(signal.SIGTERM, None)
        thread.join(10)
        assert not thread.is_alive(), "the server waited out its grace period for the body still arriving"
        answer = b""
        while chunk := trickling.recv(65536):
            answer += chunk
    assert time.perf_counter() - start < 5 and not engine.thread.is_alive()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert json.loads(body)["error"] == {"message": "the server is shutting down", "type": "server_error",
                                         "param": None, "code": None}


def test_a_request_not_yet_in_the_engine_at_the_grace_periods_end_gets_the_503(monkeypatch):
    """At the grace period's end only the engine's jobs were cut: a request whose prompts were still being tokenized
    (a worker thread) was then cancelled by uvicorn, which answered a plain-text 500 and logged a traceback; and one
    submitted between the cut and the cancel was queued and run for nobody. It gets the shutdown's 503, and the
    engine, stopping, queues nothing more."""
    import blockpress.serve as serve

    tokenizing, done = threading.Event(), threading.Event()
    batch = serve.completion_batch

    def slow(*args, **kwargs):  # a request of many long prompts, still in its worker thread at the grace's end
        tokenizing.set()
        time.sleep(1.0)
        try:
            return batch(*args, **kwargs)
        finally:
            done.set()

    monkeypatch.setattr(serve, "completion_batch", slow)
    srv, thread, base = _threaded_server(grace=0.2)
    engine = srv.config.app.state.engine
    submitted = []
    monkeypatch.setattr(engine, "submit", lambda jobs, submit=engine.submit: (submitted.append(jobs), submit(jobs)))
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, base + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=15)
        assert tokenizing.wait(15)
        srv.should_exit = True
        r = answer.result()
    assert r.status_code == 503, r.text
    assert r.json()["error"] == {"message": "the server is shutting down", "type": "server_error", "param": None,
                                 "code": None}
    thread.join(15)
    assert not thread.is_alive() and done.wait(15)
    assert engine.stopped() == "the server is shutting down" and not engine.waiting


def test_a_stop_signal_whose_line_cannot_be_written_still_stops(monkeypatch):
    """With stderr a pipe whose reader had gone (`serve 2>&1 | tee log` after tee ended), the "stopping" line raised
    BrokenPipeError in the signal handler before uvicorn took the signal: the signal was lost (the server served
    on), or the error, raised into the event loop, ended the server at once with no grace period (141)."""
    import signal

    import blockpress.cli.serve
    from blockpress.cli.serve import _server_class

    class Gone:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def isatty(self):
            return False

    silenced = []
    monkeypatch.setattr(blockpress.cli.serve, "silence_output", lambda: silenced.append(True), raising=False)
    monkeypatch.setattr("sys.stderr", Gone())
    srv = _server_class()(uvicorn.Config(lambda scope, receive, send: None))
    srv.handle_exit(signal.SIGTERM, None)
    assert srv.should_exit and silenced  # taken, and stderr pointed at the null device (its last flush)


def test_a_stop_signal_ignored_when_the_server_starts_stays_ignored():
    """A server started with SIGINT ignored (a script's `blockpress serve &`) took it over anyway (uvicorn installs
    its handler over SIG_IGN), stopped on a SIGINT, and exited 0: uvicorn's raise once shut down, under the SIG_IGN
    put back, did nothing. An ignored signal now stays ignored, as generate and train leave it."""
    import signal

    from blockpress.cli.serve import _server_class

    srv = _server_class()(uvicorn.Config(lambda scope, receive, send: None))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with srv.capture_signals():
            signal.raise_signal(signal.SIGINT)
            assert signal.getsignal(signal.SIGTERM) == srv.handle_exit  # one not ignored: the server's
        assert (srv.signals, srv.should_exit) == (0, False)  # nothing stopped
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_low_temperature_tempers_the_draws_not_the_acceptance(client):
    """temperature scaled the whole schedule, so at 0.05 every position looked certain and the entropy bound took a
    canvas of noise in a pass or two (`ospathpathpath...`). It now tempers only the candidate draws: acceptance
    keeps the schedule, so a temperature near 0 gives the greedy answer, in as many passes."""
    for seed in (1, 2, 3):
        kw = dict(model=MODEL, prompt="hello", max_tokens=32, seed=seed, extra_body={"max_denoising_steps": 8})
        greedy, cold = (client.completions.create(temperature=t, **kw) for t in (0, 1e-3))
        assert cold.choices[0].text == greedy.choices[0].text
        assert cold.usage.model_extra["forward_passes"] == greedy.usage.model_extra["forward_passes"]


def test_drafts_are_made_only_for_requests_that_asked(server, monkeypatch):
    """The engine streamed a draft every step (three device->host copies) just to notice clients leaving; now it
    asks for drafts only when a request wants them and hears about cancellation through `cancelled`."""
    lm = server[1].state.engine.lm
    asked = []
    stream = lm.stream
    monkeypatch.setattr(lm, "stream", lambda *a, **k: (asked.append((k["drafts"], k.get("cancelled"))), stream(*a, **k))[1])
    for drafts in (False, True):
        with httpx.stream("POST", server[0] + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": 8, "seed": 1, "stream": True, "drafts": drafts}) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert any('"draft"' in x for x in lines) == drafts and lines[-1] == "data: [DONE]"
    # each request's stream twice: its job checked alone (Engine.check), then run
    assert [d for d, _ in asked] == [False, False, True, True] and all(callable(c) for _, c in asked)


def test_a_suffix_heals_the_prompts_trailing_space_into_the_hole():
    """The README's example: "return " encodes its space as a lone " " token, which stayed in the prompt, and the
    model went on mid-word ("return atures.lower()"). The space now joins the hole, as in a text template: the
    answer is what the library gives for that healed layout, its first token starts with the space, and the text
    leaves the space out (it is the prompt's)."""
    from fastapi.testclient import TestClient

    lm = load_model("blockpress-code", "float32", "cpu")
    tok = lm.tokenizer
    prompt, suffix = "def area(r):\n    return ", "\n"
    body = {"model": MODEL, "prompt": prompt, "suffix": suffix, "max_tokens": 8, "temperature": 0}
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:
        plain = http.post("/v1/completions", json=body).json()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    ids = tok.encode_prompt(prompt)
    assert tok.token_texts()[ids[-1]] == " "
    direct = lm.generate([ids[:-1]], template=[ids[-1:] + [-1] * 8 + tok.encode(suffix)], sampler="greedy", seeds=[0],
                         token_healing=True)
    answer = direct.new_tokens[0, :8].tolist()
    assert tok.token_texts()[answer[0]].startswith(" ")
    text = plain["choices"][0]["text"]
    assert text == tok.decode(answer)[1:] and not text.startswith(" ")
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    # the suffix is prompt text, as OpenAI counts it
    assert plain["usage"]["completion_tokens"] == 8 and plain["usage"]["prompt_tokens"] == len(ids) + len(tok.encode(suffix))
    # the library's rule, which the server calls: lm.infill with the same text prompt writes the same hole
    assert lm.infill("<|hole:8|>" + suffix, prompt=prompt, sampler="greedy", seeds=[0]).fills[0][0] == text
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:  # a list of texts heals each one too
        listed = http.post("/v1/completions", json={**body, "prompt": [prompt, prompt]}).json()
    assert [c["text"] for c in listed["choices"]] == [text, text]


def test_a_hole_marker_in_a_suffix_is_text_not_the_noise_token():
    """A FIM client sends the rest of the file as `suffix`: one that mentions "<|hole|>" (this engine's own code and
    docs) was encoded with the marker as blockpress-code's absorbing noise token, a masked position in the fixed text.
    The suffix is encoded as lm.infill encodes escape_template(suffix): the marker is plain text."""
    from fastapi.testclient import TestClient

    from blockpress import escape_template

    lm = load_model("blockpress-code", "float32", "cpu")
    tok = lm.tokenizer
    prompt, suffix = "marker = ", "'<|hole|>'\n"
    noise = tok.encode("<|hole|>")
    assert len(noise) == 1 and noise[0] in tok.encode(suffix)  # (what the server encoded the suffix as)
    fixed = tok.encode("'") + tok.encode_plain("<|hole|>") + tok.encode("'\n")
    assert noise[0] not in fixed
    body = {"model": MODEL, "prompt": prompt, "suffix": suffix, "max_tokens": 4, "seed": 3}
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0)) as http:
        r = http.post("/v1/completions", json=body).json()
    assert r["usage"]["prompt_tokens"] == len(tok.encode_prompt(prompt)) + len(fixed)  # the suffix's plain tokens
    assert r["choices"][0]["text"] == lm.infill("<|hole:4|>" + escape_template(suffix), prompt=prompt,
                                                seed=3).fills[0][0]


def test_suffix_jobs_of_different_healed_lengths_share_a_batch():
    """A healed suffix canvas is a token shorter once its space opens into the hole: batched with an unhealed one of
    the same length before healing, the engine refused the batch and both clients got a 500; then jobs batched by
    their healed length. The engine now takes canvases of any lengths together: one key, and each row as alone."""
    import asyncio

    from blockpress.serve import CompletionRequest, ServerState, completion_jobs, completion_prompts

    lm = load_model("blockpress-code", "float32", "cpu")
    state = ServerState(lm, None, MODEL, 512)
    tok = lm.tokenizer
    healed = CompletionRequest(model=MODEL, prompt="def area(r):\n    return ", suffix="\n", max_tokens=8)
    suffix = next(s for s in ("\nx", "\n\nx", "\n\n\nx", "\nprint(r)") if len(tok.encode(s)) == 2)
    plain = CompletionRequest(model=MODEL, prompt="def area(r):\n    return", suffix=suffix, max_tokens=8)

    async def jobs(body):
        (prompt, from_text), = completion_prompts(state, body)
        return completion_jobs(state, body, prompt, from_text)[0]

    a, b = asyncio.run(jobs(healed)), asyncio.run(jobs(plain))
    assert len(a.canvas) == len(b.canvas) and a.key() == b.key()
    kw = dict(token_healing=True, max_denoising_steps=2)
    both = lm.generate([a.prompt, b.prompt], template=[a.canvas, b.canvas], seeds=[1, 2], **kw)
    for r, job in enumerate((a, b)):
        alone = lm.generate([job.prompt], template=[job.canvas], seeds=[r + 1], **kw)
        assert both.fills[r] == alone.fills[0] and int(both.num_new_tokens[r]) == int(alone.num_new_tokens[0])
    assert both.num_new_tokens.tolist() == [len(a.canvas) - 1, len(b.canvas)]  # healed: a space into the hole


def test_template_requests_of_different_lengths_share_a_batch_and_answer_as_alone(server, monkeypatch):
    """Canvas jobs batched only when their canvases (healed) came to the same number of tokens, since the engine
    refused a batch of templates of different lengths: concurrent infill clients ran one by one. Now they share a
    batch, one canvas spanning two of the model's canvases beside one that fits in one, and each answer and usage
    is the request's alone."""
    bodies = [{"model": MODEL, "prompt": "# p\n", "template": "x = <|hole:3|>\n", "max_tokens": 10, "seed": 1},
              {"model": MODEL, "prompt": "abc", "template": "def f(a):\n    return a + <|hole:4|>\n\ny = f(<|hole:2|>)\n",
               "max_tokens": 20, "seed": 2},
              {"model": MODEL, "prompt": "z", "suffix": " + 1\n", "max_tokens": 5, "seed": 3}]
    first = {"model": MODEL, "prompt": "q", "template": "<|hole:1|>", "max_tokens": 1}
    alone, batches = alone_then_batched(server, monkeypatch, bodies, first, lambda j: len(j.canvas))
    assert len(batches) == 2 and len(set(batches[1])) == 3 and max(batches[1]) > server[1].state.engine.lm.config.canvas_length
    assert len({a["choices"][0]["text"] for a in alone}) == len(bodies)


def test_a_canvas_counts_its_fixed_tokens_as_prompt_tokens(server):
    """A template's text (and a suffix) was counted in neither prompt_tokens nor completion_tokens: the client wrote
    it, and the model reads it, so it is prompt; the holes the model writes are the completion."""
    tok = server[1].state.engine.lm.tokenizer
    before, after = "def f(a):\n    return a +", "\n\ny = 1\n"
    body = {"model": MODEL, "prompt": "abc", "template": before + "<|hole:4|>" + after, "max_tokens": 8, "seed": 2}
    usage = httpx.post(server[0] + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == len(tok.encode_prompt("abc")) + len(tok.encode(before)) + len(tok.encode(after))
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == usage["prompt_tokens"] + 4
    body = {"model": MODEL, "prompt": "abc", "suffix": after, "max_tokens": 3, "seed": 2}
    usage = httpx.post(server[0] + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(tok.encode_prompt("abc")) + len(tok.encode(after)), 3)


def test_streamed_choices_interleave(server):
    """n choices run in one batch, but a stream sent choice 1's chunks only once choice 0 had finished: they now
    come as the engine commits them, each choice's text still adding up to its plain answer."""
    body = {"prompt": "x", "max_tokens": 48, "min_tokens": 48, "n": 2, "seed": 3}  # three canvases each, no EOS
    chunks = sse_chunks(server, "/v1/completions", body)
    order = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert order.index((1, None)) < order.index((0, "length"))
    plain = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, **body}, timeout=60).json()
    for choice in plain["choices"]:
        i = choice["index"]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) == choice["text"]


def test_a_batch_of_prompts_answers_each_as_alone(client, server):
    """OpenAI's /v1/completions takes a list of prompts (LangChain's OpenAI wrapper always sends one); it was refused.
    Choice j of prompt i has index i*n + j and is that prompt's answer alone; the usage adds up."""
    prompts = ["abc", "hello there"]
    kw = dict(model=MODEL, max_tokens=12, n=2, seed=4)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    both = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
    for name in ("prompt_tokens", "completion_tokens"):
        assert getattr(both.usage, name) == sum(getattr(a.usage, name) for a in alone)
    ids = [server[1].state.engine.lm.tokenizer.encode_prompt(p) for p in prompts]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == [c.text for c in both.choices]
    streamed = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert [streamed[i] for i in range(4)] == [c.text for c in both.choices]
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": [[5], []]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt[1]: must not be empty"


@pytest.mark.parametrize("body, param, says", [
    # before: "messages.0.content.str: Input should be a valid string", for an image part as for null
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "only text parts are supported (messages[0].content[0].type is 'image_url')"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content",
     "expected str or a list of text parts, got null"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'assistant'"),
    # an OpenAI chat field the legacy completions do not take (it silently won over max_tokens)
    ({"prompt": "x", "max_tokens": 4, "max_completion_tokens": 8}, "max_completion_tokens", "takes max_tokens"),
    # in plain words, not pydantic's "List should have at least 1 item after validation, not 0"
    ({"messages": []}, "messages", "messages: must not be empty"),
    ({"prompt": None}, "prompt", "prompt: expected str or list[int] or list[str] or list[list[int]], got null"),
])
def test_nested_errors_name_the_field_as_openai_writes_it(server, body, param, says):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server[0] + path, json={"model": MODEL, **body}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and says in err["message"], err


# A tool-use template in the manner of Gemma 4's: tools in a system turn, an assistant's calls with their arguments
# as an object (it iterates them: a string would fail), results in "tool" turns naming their call.
TOOL_TEMPLATE = """{{- bos_token -}}
{%- if tools -%}<|turn>system
{% for t in tools %}<|tool>{{ t | tojson }}<tool|>{% endfor %}<turn|>
{% endif -%}
{%- for m in messages -%}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}
{%- if m['tool_call_id'] is defined %} [{{ m['tool_call_id'] }}]{% endif %}
{% if m['content'] is string %}{{ m['content'] | trim }}{% endif -%}
{%- for c in m['tool_calls'] or [] -%}<|tool_call>{{ c['id'] }}:{{ c['function']['name'] }}(
{%- for k, v in c['function']['arguments'] | dictsort %}{{ k }}={{ v | tojson }},{% endfor %})<tool_call|>
{%- endfor %}<turn|>
{% endfor -%}
{%- if add_generation_prompt %}<|turn>model
{% endif -%}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Today's weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_TURNS = [
    {"role": "system", "content": "You may call tools."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo", "n": [1]}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
]


def test_a_tool_conversation_renders_as_transformers_renders_it(server, monkeypatch, tmp_path):
    """Agent loops send tools, an assistant's tool_calls (content null) and tool results: all were refused (400),
    though the checkpoint's template renders them. Now they reach the template, and the prompt is what transformers
    makes of the same conversation (arguments as the object the JSON text holds, as its tool-use templates take
    them); the reply stays text."""
    from transformers import AutoTokenizer

    app = server[1]
    lm, engine = app.state.engine.lm, app.state.engine
    monkeypatch.setattr(lm.tokenizer, "chat_template", TOOL_TEMPLATE)
    lm.tokenizer.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    sent = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda jobs: (sent.append(jobs[0].prompt), submit(jobs))[1])
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": TOOL_TURNS, "tools": TOOLS, "max_tokens": 4, "seed": 1})
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["choices"][0]["message"]["content"], str)
    theirs = [dict(m) for m in TOOL_TURNS]
    theirs[2] = {**theirs[2], "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in theirs[2]["tool_calls"]]}
    theirs[4] = {**theirs[4], "content": "rain"}
    text = hf.apply_chat_template(theirs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<|tool_call>c2:weather(city=\"Oslo\",n=[1],)" in text and "<|turn>tool [c1]sunny" in text
    assert sent == [hf.encode(text, add_special_tokens=False)]
    # `tools: []` (what some clients send for none) is no tools, as is leaving them out
    for extra in ({"tools": []}, {}):
        r = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": TOOL_TURNS, "max_tokens": 4, **extra})
        assert r.status_code == 200, r.text
    assert sent[-1] == sent[-2] == hf.encode(hf.apply_chat_template(theirs, add_generation_prompt=True,
                                                                     tokenize=False), add_special_tokens=False)


def test_a_tool_call_turn_with_null_content_is_rendered_not_a_server_error(server, monkeypatch):
    """An agent loop sends the tool-call turn back as OpenAI's clients (and this server's replies) write it, content
    null: under a template that reads message.content (Qwen 3's, QwQ's, Phi-3.5's, ...) it was a 500 "chat_template:
    rendering failed: UndefinedError", which the openai SDK retries. It renders as "" (vLLM's), a 200."""
    from test_tokenizer import QWEN3_STYLE_TEMPLATE

    lm, sent = server[1].state.engine.lm, []
    monkeypatch.setattr(lm.tokenizer, "chat_template", QWEN3_STYLE_TEMPLATE)
    submit = server[1].state.engine.submit
    monkeypatch.setattr(server[1].state.engine, "submit", lambda jobs: (sent.append(jobs[0].prompt), submit(jobs))[1])
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": TOOL_TURNS, "max_tokens": 2, "seed": 1})
    assert r.status_code == 200, r.text
    assert "<|im_start|>assistant\n<tool_call>" in lm.tokenizer.decode(sent[0], skip_special_tokens=False)


def with_call(**change):
    """TOOL_TURNS[:3] with the first tool call's fields changed (None: removed)."""
    call = {**TOOL_TURNS[2]["tool_calls"][0]}
    function = {**call["function"]}
    for key, value in change.items():
        target = function if key in ("name", "arguments") else call
        target.pop(key) if value is None else target.update({key: value})
    call["function"] = function
    return TOOL_TURNS[:2] + [{**TOOL_TURNS[2], "tool_calls": [call]}]


@pytest.mark.parametrize("body, param, says", [
    ({"messages": with_call(arguments={"city": "Paris"})}, "messages[2].tool_calls[0].function.arguments",
     "JSON text (a string"),
    ({"messages": with_call(arguments="Paris")}, "messages[2].tool_calls[0].function.arguments",
     "expected a JSON object as text, got 'Paris'"),
    ({"messages": with_call(arguments="[1]")}, "messages[2].tool_calls[0].function.arguments", "JSON object"),
    # nested past Python's recursion limit: a RecursionError answered 500
    ({"messages": with_call(arguments="[" * 5000 + "]" * 5000)}, "messages[2].tool_calls[0].function.arguments",
     "JSON object"),
    ({"messages": with_call(id=None)}, "messages[2].tool_calls[0].id", "required"),
    ({"messages": with_call(name=None)}, "messages[2].tool_calls[0].function.name", "required"),
    ({"messages": with_call(type="code")}, "messages[2].tool_calls[0].type", "'function'"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id", "names the call it answers"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id",
     "only a tool message"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "only an assistant message"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "got null"),
    # OpenAI refuses an empty list of parts (it rendered an empty user turn and answered 200)
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "an empty list of parts"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name", "required"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice",
     "does not force tool calls"),
    ({"prompt": "x", "tools": TOOLS}, "tools", "only /v1/chat/completions"),
])
def test_malformed_tool_calls_and_empty_content_get_a_400_naming_the_field(server, body, param, says):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server[0] + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and says in err["message"], err


def test_tools_are_refused_where_the_chat_template_never_reads_them(server):
    """The tiny model's Gemma-style template has no place for tools: they would vanish from the prompt unsaid."""
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tools" and "does not use tools" in err["message"], err
    # a tool message is the template's to refuse (this one has no tool role): a 400 in its words
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=30, json={"model": MODEL, "messages": TOOL_TURNS[3:4]})
    assert r.status_code == 400 and "tool" in r.json()["error"]["message"], r.text


def test_a_body_not_sent_as_json_names_the_header_and_health_answers_head(server):
    r = httpx.post(server[0] + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": "x"}),
                   headers={"content-type": "application/x-www-form-urlencoded"})  # what plain `curl -d` sends
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    assert httpx.head(server[0] + "/health").status_code == 200


def test_the_openapi_schema_is_served_without_a_warning(server):
    """/health answered GET and HEAD from one route, both with one operation id: every fetch of /openapi.json (a
    visit to /docs) warned of the duplicate in the server's log."""
    import warnings

    from fastapi.openapi.utils import get_openapi

    app = server[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    assert "get" in schema["paths"]["/health"]


def test_openai_temperature_samples_where_the_checkpoint_takes_argmax_candidates():
    """A checkpoint with candidates="argmax" ignored OpenAI's temperature: candidates are drawn when one is sent."""
    from blockpress.sampling import SamplerConfig
    from blockpress.serve import CompletionRequest, sampler_config

    argmax = SamplerConfig(candidates="argmax")
    hot = sampler_config(argmax, CompletionRequest(model=MODEL, prompt="x", temperature=0.7))
    assert hot.candidates == "sample" and hot.draw_temperature == 0.7
    assert sampler_config(argmax, CompletionRequest(model=MODEL, prompt="x")).candidates == "argmax"
    zero = sampler_config(argmax, CompletionRequest(model=MODEL, prompt="x", temperature=0))
    assert zero.sampler == argmax.sampler and zero.argmax_candidates  # the checkpoint's rule, argmax candidates


def test_top_p_and_top_k_filter_the_draws_on_the_server():
    """top_p was refused unless 1.0: it filters the candidate draws now (SamplerConfig.top_p, as generate and
    generate_ar take it), and the extra top_k likewise."""
    from blockpress.sampling import SamplerConfig
    from blockpress.serve import ChatRequest, CompletionRequest, sampler_config

    cfg = sampler_config(SamplerConfig(), CompletionRequest(model=MODEL, prompt="x", temperature=0.7, top_p=0.9, top_k=5))
    assert (cfg.top_p, cfg.top_k, cfg.draw_temperature) == (0.9, 5, 0.7)
    chat = ChatRequest(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=0.5)
    assert sampler_config(SamplerConfig(top_k=3), chat).top_p == 0.5 and sampler_config(SamplerConfig(top_k=3), chat).top_k == 3


def tool_server(tmp_path, monkeypatch, own_template=True):
    """A tiny model whose tokenizer has Gemma 4's turn and tool-call markers as special tokens, TOOL_TEMPLATE and
    test_response's GEMMA4 response template (`own_template`: in its tokenizer_config.json; else none there, as a
    real Gemma 4 checkpoint has, and the built-in one reads the replies), served, with its replies forced: `reply[0]`
    is what it writes, in canvases of `reply[1]` tokens (0: all at once)."""
    import tokenizers
    import torch
    from test_response import GEMMA4

    from blockpress.generate import Commit, Done, GenerationOutput
    from blockpress.tokenizer import Tokenizer

    lm = load_model("random-tiny", None, "cpu")
    lm.tokenizer.chat_template = TOOL_TEMPLATE
    lm.tokenizer.save(tmp_path)
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.add_special_tokens(["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                                "<|channel>", "<channel|>"])  # ids past the tokenizer's, within the model's 512
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if own_template:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "response_template": GEMMA4}))
    lm.tokenizer = tok = Tokenizer.from_dir(tmp_path)
    reply = ["", 0]

    def forced(prompts, **kwargs):  # the engine's output: reply[0]'s tokens and the end of turn, for every row
        ids, b = tok.encode(reply[0]) + [lm._eos_ids()[0]], len(prompts)
        for k, start in enumerate(range(0, len(ids), reply[1] or len(ids))):
            n = min(len(ids), start + (reply[1] or len(ids)))
            yield Commit(k, torch.tensor([ids[start:n]] * b), torch.ones(b), torch.full((b,), n == len(ids)), 0.0,
                         None, torch.full((b,), n), [tok.decode(ids[:n])] * b)
        yield Done(GenerationOutput(
            sequences=torch.tensor([ids] * b), prompt_length=0, texts=[tok.decode(ids)] * b,
            tokens_per_forward=torch.ones(b), forward_passes=torch.ones(b, dtype=torch.long),
            num_new_tokens=torch.full((b,), len(ids)), steps_per_canvas=torch.ones(b, 1, dtype=torch.long),
            extra={"stopped": [False] * b, "reused_prompt_tokens": [0] * b}))

    monkeypatch.setattr(lm, "stream", forced)
    base, srv = start_in_background(create_app(lm, MODEL))
    return base, srv, lm, reply


def test_tool_calls_come_back_as_openais_tool_calls(tmp_path, monkeypatch):
    """The reply was text whatever the model wrote, its tool calls left for the client to find in the model's own
    syntax. With the checkpoint's response template they come back as OpenAI's message.tool_calls (arguments as JSON
    text), the rest as the content, finish_reason "tool_calls"; streamed, as they are written. A reply
    with no call, tool_choice "none", a call the template cannot read, or a checkpoint with no response template:
    text, as before (but for a thought before the calls that tool_choice "none" makes text, which stays apart)."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        paris, oslo = {"city": "Paris, FR", "days": 2, "hours": [9, 12.5]}, {"city": "Oslo", "metric": True}
        reply[0] = (f"<|channel>thought\nTwo cities.<channel|>Checking both.<|tool_call>call:weather{gemma_value(paris)}"
                    f"<tool_call|><|tool_call>call:weather{gemma_value(oslo)}<tool_call|>")
        kw = dict(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=200, seed=1)
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking both."
        calls = choice.message.tool_calls
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("function", "weather", paris), ("function", "weather", oslo)]
        assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
        assert choice.message.model_extra["reasoning_content"] == "Two cities."

        assert streamed_message(client, **kw) == whole_message(client, **kw)
        # in canvases of 3 tokens: the thought and the content come as they commit, each call before the reply ends
        # (the thought came whole at the end, and with it every piece of content)
        reply[1] = 3
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw)]
        thought = [i for i, c in enumerate(chunks) if (c.delta.model_extra or {}).get("reasoning_content")]
        said = [i for i, c in enumerate(chunks) if c.delta.content]
        called = [i for i, c in enumerate(chunks) if c.delta.tool_calls]
        assert len(thought) > 1 and len(said) > 1 and thought[-1] < said[0] and said[-1] < called[0]
        assert [chunks[i].delta.tool_calls[0].index for i in called] == [0, 1] and called[-1] < len(chunks) - 1
        assert streamed_message(client, **kw) == whole_message(client, **kw)
        # a thought and no call: the thought is apart from the answer, as with calls (it was in the content)
        reply[0] = "<|channel>thought\nNo tool needed.<channel|>It is sunny.<turn|>"
        choice = client.chat.completions.create(**kw).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("It is sunny.", None,
                                                                                             "stop")
        assert choice.message.model_extra["reasoning_content"] == "No tool needed."
        assert streamed_message(client, **kw) == whole_message(client, **kw)
        reply[0] = f"<|channel>thought\nTwo cities.<channel|>Checking both.<|tool_call>call:weather{gemma_value(paris)}"
        reply[0] += f"<tool_call|><|tool_call>call:weather{gemma_value(oslo)}<tool_call|>"
        usage = [c.usage for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                                  **kw)]
        assert usage[:-1] == [None] * (len(usage) - 1) and usage[-1] == client.chat.completions.create(**kw).usage
        reply[1] = 0

        def text_reply(**extra):
            choice = client.chat.completions.create(**{**kw, **extra}).choices[0]
            assert choice.message.tool_calls is None and choice.finish_reason == "stop"
            assert streamed_message(client, **{**kw, **extra}) == whole_message(client, **{**kw, **extra})
            return choice.message.content, (choice.message.model_extra or {}).get("reasoning_content")

        # no tools: the calls are text (the special tokens left out, as ever), the thought before them the reasoning
        after = lm.tokenizer.decode(lm.tokenizer.encode(reply[0].split("<channel|>")[1]))
        assert text_reply(tool_choice="none") == (after, "Two cities.")
        assert text_reply(tools=[]) == (after, "Two cities.")
        reply[0] = "<|tool_call>call:weather{city:Paris}<tool_call|>"  # an unquoted string: not JSON
        assert text_reply() == ("call:weather{city:Paris}", None)
        # arguments that are no object: answered as '[1, 2]', which the server refused when the agent sent it back
        reply[0] = "<|tool_call>call:weather[1,2]<tool_call|>"
        assert text_reply() == ("call:weather[1,2]", None)
        reply[0] = "No call needed.<turn|>"
        assert text_reply() == ("No call needed.", None)
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "No call needed."
        assert chunks[-1].choices[0].finish_reason == "stop"
        reply[0] = f"<|tool_call>call:weather{gemma_value(oslo)}<tool_call|>"
        lm.tokenizer.response_template = None  # a checkpoint without one, and no built-in one: text, as before
        monkeypatch.setattr("blockpress.tokenizer.builtin_response_template", lambda is_special: None)
        assert text_reply() == ("call:weather{city:Oslo,metric:true}", None)
    finally:
        srv.should_exit = True


def test_an_agent_loop_sends_a_reply_with_its_thought_back(tmp_path, monkeypatch):
    """A reply's thought comes back as reasoning_content, and an agent loop appends the message as it came (OpenAI's
    client sends its extra fields) with the tool results: the next request was refused, "unknown field
    'messages[2].reasoning_content'". The thought now reaches the template, as the chat command gives it."""
    base, srv, lm, reply = tool_server(tmp_path, monkeypatch, own_template=False)
    monkeypatch.setattr(lm.tokenizer, "chat_template", TOOL_TEMPLATE.replace(
        "{% if m['content'] is string %}", "{% if m['reasoning_content'] %}[{{ m['reasoning_content'] }}]{% endif %}"
        "{% if m['content'] is string %}"))
    prompts, forced = [], lm.stream
    monkeypatch.setattr(lm, "stream", lambda ids, **kw: (prompts.extend(ids), forced(ids, **kw))[1])
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        reply[0] = "<|channel>thought\nCheck Oslo.<channel|><|tool_call>call:weather{city:<|\"|>Oslo<|\"|>}<tool_call|>"
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        message = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message
        assert message.model_extra["reasoning_content"] == "Check Oslo." and message.tool_calls
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        reply[0] = "It is sunny."
        assert client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message.content \
            == "It is sunny."
        assert "[Check Oslo.]" in lm.tokenizer.decode(prompts[-1])
        bad = [{"role": "user", "content": "hi", "reasoning_content": "no"}]
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.reasoning_content: only an assistant"):
            client.chat.completions.create(model=MODEL, messages=bad)
    finally:
        srv.should_exit = True


def test_a_gemma4_checkpoint_without_a_response_template_answers_with_calls_and_thoughts(tmp_path, monkeypatch):
    """A real Gemma 4 or DiffusionGemma checkpoint ships no response_template, so its replies came back as text: the
    calls unread ("call:weather{city:Oslo}"), the thought glued to the answer ("thoughtTwo cities.Checking both.").
    Its tokenizer's markers call for the built-in Gemma 4 template: calls come back as OpenAI's tool_calls, and a
    thought as reasoning_content, a request without tools too (read for its thought alone: a call it writes anyway
    is text, as before); streamed, the chunks add up to the same answer."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch, own_template=False)
    assert lm.tokenizer.response_template is None
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        paris, oslo = {"city": "Paris"}, {"city": "Oslo"}
        reply[0] = (f"<|channel>thought\nTwo cities.<channel|>Checking both.<|tool_call>call:weather{gemma_value(paris)}"
                    f"<tool_call|><|tool_call>call:weather{gemma_value(oslo)}<tool_call|><|tool_response>")
        kw = dict(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=200, seed=1)
        answer = {"content": "Checking both.", "tool_calls": [("function", "weather", paris),
                                                            ("function", "weather", oslo)],
                  "finish_reason": "tool_calls", "reasoning_content": "Two cities."}
        no_tools = {**kw, "tools": None}
        for canvas in (0, 3):
            reply[1] = canvas
            assert whole_message(client, **kw) == streamed_message(client, **kw) == answer
            for thought, reasoning in (("Short.", "Short."), ("", None)):  # an empty thought: none, and not glued
                reply[0] = f"<|channel>thought\n{thought}<channel|>It is sunny.<turn|>"
                assert whole_message(client, **no_tools) == streamed_message(client, **no_tools) == {
                    "content": "It is sunny.", "tool_calls": [], "finish_reason": "stop",
                    "reasoning_content": reasoning}
            reply[0] = f"Checking.<|tool_call>call:weather{gemma_value(oslo)}<tool_call|>"  # no tools offered
            assert whole_message(client, **no_tools) == streamed_message(client, **no_tools) == {
                "content": "Checking.call:weather{city:Oslo}", "tool_calls": [], "finish_reason": "stop",
                "reasoning_content": None}
            reply[0] = answer_text = "It is <b>sunny</b>.<turn|>"  # no thought, no call: the plain text, as before
            assert whole_message(client, **no_tools) == streamed_message(client, **no_tools) == {
                "content": lm.tokenizer.decode(lm.tokenizer.encode(answer_text)), "tool_calls": [],
                "finish_reason": "stop", "reasoning_content": None}
            reply[0] = (f"<|channel>thought\nTwo cities.<channel|>Checking both.<|tool_call>call:weather"
                        f"{gemma_value(paris)}<tool_call|><|tool_call>call:weather{gemma_value(oslo)}<tool_call|>")
        # tokens that are not Gemma 4's (no built-in template): a thought is the content's start, as before
        monkeypatch.setattr("blockpress.tokenizer.builtin_response_template", lambda is_special: None)
        reply[0], reply[1] = "<|channel>thought\nShort.<channel|>It is sunny.<turn|>", 0
        assert whole_message(client, **no_tools)["content"] == "thought\nShort.It is sunny."
    finally:
        srv.should_exit = True


def test_a_reply_without_tools_that_thinks_then_calls_streams_what_it_answers(tmp_path, monkeypatch):
    """A request without tools is read for its thought alone, and a call its reply writes anyway makes the reply
    text. Where the thought came before the call, a stream had sent the thought as reasoning_content (and the
    content after it) before the call's marker showed, yet answered, as unstreamed, the whole text with the thought
    glued to it: chunks of reasoning 'Let me think.' and content 'Checking.' against the answer
    'thought\nLet me think.Checking.call:weather{city:Oslo}'. Both now answer with that thought as reasoning_content
    and the rest of the reply as text (its special tokens left out, the ends trimmed as the template trims a
    content), a call that does not read too; a call before any thought leaves the reply text, as before, and the
    stream sends no thought."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch, own_template=False)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    call = f"<|tool_call>call:weather{gemma_value({'city': 'Oslo'})}<tool_call|>"
    kw = dict(model=MODEL, messages=TOOL_TURNS[:2], max_tokens=200, seed=1)
    answer = {"tool_calls": [], "finish_reason": "stop", "reasoning_content": "Let me think."}
    try:
        for written, content, reasoning in [
                (f"<|channel>thought\nLet me think.<channel|> Checking. {call} Done.<turn|>",
                 "Checking. call:weather{city:Oslo} Done.", "Let me think."),
                (f"Sure. <|channel>thought\nLet me think.<channel|>Checking.{call}",
                 "Sure. Checking.call:weather{city:Oslo}", "Let me think."),
                ("<|channel>thought\nLet me think.<channel|>Checking.<|tool_call>call:weather{city:}<tool_call|>",
                 "Checking.call:weather{city:}", "Let me think."),  # a call that does not read: text all the same
                # ended inside the call's name (a stop string, max_tokens): its pattern's \w+ could have gone on,
                # so the call was not found, and the thought was glued into the content (the stream lost the rest)
                ("<|channel>thought\nLet me think.<channel|>Checking.<|tool_call>call:weathe",
                 "Checking.call:weathe", "Let me think."),
                (f"Checking.{call}<|channel>thought\nHm.<channel|>Done.<turn|>",
                 "Checking.call:weather{city:Oslo}thought\nHm.Done.", None)]:
            for canvas in (0, 1, 3, 5):
                reply[0], reply[1] = written, canvas
                expected = {**answer, "content": content, "reasoning_content": reasoning}
                assert whole_message(client, **kw) == expected, written
                assert streamed_message(client, **kw) == expected, (written, canvas)
    finally:
        srv.should_exit = True


def test_greedy_copies_of_a_call_carry_ids_of_their_own(tmp_path, monkeypatch):
    """n greedy choices are one answer computed once: their tool calls shared one id across the choices, streamed
    or not, where OpenAI's ids are unique per call (code that gathers calls by id merged them)."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch, own_template=False)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    reply[0], reply[1] = f"<|tool_call>call:weather{gemma_value({'city': 'Oslo'})}<tool_call|>", 1
    kw = dict(model=MODEL, messages=TOOL_TURNS[:1], tools=TOOLS, max_tokens=200, n=3, temperature=0)
    try:
        whole = client.chat.completions.create(**kw).choices
        assert [c.message.tool_calls[0].function.arguments for c in whole] == ['{"city": "Oslo"}'] * 3
        streamed = {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                for t in c.delta.tool_calls or []:
                    if t.id:
                        streamed[c.index] = t.id
        for ids in ([c.message.tool_calls[0].id for c in whole], [streamed[i] for i in range(3)]):
            assert len(set(ids)) == 3 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids), ids
    finally:
        srv.should_exit = True


def test_every_sampled_choice_of_a_tool_stream_finishes(tmp_path, monkeypatch):
    """n sampled choices are rows of their own: a streamed reply with tools sends each its calls and its
    finish_reason before [DONE] (it stopped at the first that finished, the others' calls lost)."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    reply[0] = f"<|tool_call>call:weather{gemma_value({'city': 'Paris'})}<tool_call|>"
    try:
        finish, names = {}, {}
        for chunk in client.chat.completions.create(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=200,
                                                    n=2, temperature=1.0, seed=1, stream=True):
            for c in chunk.choices:
                finish[c.index] = c.finish_reason or finish.get(c.index)
                names[c.index] = names.get(c.index, []) + [t.function.name for t in c.delta.tool_calls or []]
        assert finish == {0: "tool_calls", 1: "tool_calls"}, (finish, names)
        assert names == {0: ["weather"], 1: ["weather"]}, names
    finally:
        srv.should_exit = True


def test_a_reply_without_tools_streams_its_leading_whitespace_with_its_text(tmp_path, monkeypatch):
    """A reply to a request without tools that opened with whitespace ("  Hello ...", "\\nHello ...") sent nothing
    until its end, then all of it in one chunk: the template's content trims the whitespace that the answer, its
    plain text, keeps, so the two shared no start. It now goes out with the first text after it, as the rest does.
    Where the request offers tools it cannot: a call would make the answer the template's content, without it, so
    such a reply's content waits for the call or the end (whitespace alone waits either way: a thought may follow)."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch, own_template=False)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    kw = dict(model=MODEL, messages=TOOL_TURNS[:2], max_tokens=200, seed=1)
    call = f"<|tool_call>call:weather{gemma_value({'city': 'Oslo'})}<tool_call|>"

    def pieces(**extra):
        return [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **kw, **extra)
                if c.choices[0].delta.content]

    try:
        for lead in ("  ", "\n"):
            reply[0], reply[1] = lead + "Hello there, how are you today?<turn|>", 3
            answer = lm.tokenizer.decode(lm.tokenizer.encode(reply[0]))
            assert answer.startswith(lead) and whole_message(client, **kw)["content"] == answer
            sent = pieces()
            assert "".join(sent) == answer and sent[0].startswith(lead) and sent[0].strip() and len(sent) > 2, sent
            assert pieces(tools=TOOLS) == [answer]  # with tools: at the end
            reply[0] = lead + "<|channel>thought\nHm.<channel|>Hello.<turn|>"  # whitespace, then a thought
            assert streamed_message(client, **kw) == whole_message(client, **kw) == {
                "content": "Hello.", "tool_calls": [], "finish_reason": "stop", "reasoning_content": "Hm."}
            reply[0] = lead + "Checking." + call
            assert whole_message(client, tools=TOOLS, **kw)["content"] == "Checking."  # (why: trimmed)
            assert streamed_message(client, tools=TOOLS, **kw)["content"] == "Checking."
    finally:
        srv.should_exit = True


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["", "  ", "\n"]), st.booleans(), st.sampled_from(["", "Checking.", " a < b ", "Sure: "]),
       st.lists(st.sampled_from(["good", "bad", "list"]), max_size=2), st.sampled_from(["", "<turn|>", "cut"]), st.booleans(),
       st.data())
def test_a_streamed_reply_adds_up_to_its_answer(lead, thought, text, calls, end, tools, data):
    """A request with or without tools, its reply cut into chunks anywhere between its tokens: the chunks that the
    stream sends (ToolStream.settle, then finish) join into the unstreamed answer (Reply.tool_message, or the plain
    text), its reasoning_content, content and calls, and the stream sends nothing its answer does not start with
    (finish warns where it did). With tools, a thought then a call the template cannot read was answered as the
    reply's text, thought and all, after the stream had sent the thought apart: it is kept apart now, as without
    tools. A malformed call after a well-formed one the stream sent made the whole answer text (the stream had sent
    the call): the calls before it are answered now, the rest dropped, streamed or not."""
    from blockpress.response import (
        GEMMA4_MARKERS,
        PartialReader,
        compile_template,
        gemma4_response_template,
        parse_response,
        regions_only,
    )
    from blockpress.serve import JobDone, JobText, Reply, ToolStream

    template = compile_template(gemma4_response_template())
    special = [*GEMMA4_MARKERS, '<|"|>']

    def plain(raw):
        for token in special:
            raw = raw.replace(token, "")
        return raw

    atoms = [lead, *(["<|channel>", "thought\nLet me think.", "<channel|>"] if thought else []), text]
    for call in calls:
        atoms += ["<|tool_call>", "call:weather", *(["{city:", '<|"|>', "Oslo", '<|"|>', "}"] if call == "good"
                                                     else ["[1,2]"] if call == "list" else ["{city:}"]), "<tool_call|>",
                  # (with tools, text after a call is the documented exception: the content keeps its last part)
                  *([] if tools else [" then"])]
    if end == "cut":  # max_tokens ends the reply inside a call
        atoms += ["<|tool_call>", "call:weather", "{city:", '<|"|>', "Os"]
    atoms = [piece for atom in atoms for piece in ([atom] if atom in special else list(atom))]
    atoms += [end] if end != "cut" else []
    raw = "".join(atoms)
    offered = TOOLS if tools else None
    reply = Reply([], "chat", MODEL, 1, parse=lambda text: parse_response(template, text, tools=offered, keep_empty=True),
                  read_partial=lambda: PartialReader(template, tools=offered), calls_wanted=tools, plain=plain,
                  read_regions=lambda: PartialReader(regions_only(template), tools=offered))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(atoms)), max_size=8)))
    stream, sent = ToolStream(), []
    for cut in cuts:
        so_far = "".join(atoms[:cut])
        sent += stream.settle(reply, JobText(plain(so_far), so_far), [])
    done = JobDone(plain(raw), len(atoms), 1, "length" if end == "cut" else "stop", 0, raw)
    rest, finish = stream.finish(reply, done)
    called = reply.tool_message(done)
    answer = called["message"] if called is not None else {"content": plain(raw)}
    joined = {key: "".join(d.get(key, "") for d in sent + rest) for key in ("content", "reasoning_content")}
    # (a reply of calls alone has content null, OpenAI's shape)
    assert joined == {"content": answer["content"] or "", "reasoning_content": answer.get("reasoning_content") or ""}, raw
    for key, whole in joined.items():  # every chunk before the last extends what was sent
        assert whole.startswith("".join(d.get(key, "") for d in sent)), raw
    def without_ids(calls):  # (each read of a reply gives its calls new ids)
        return [{k: v for k, v in call.items() if k not in ("index", "id")} for call in calls]

    assert without_ids(c for d in sent + rest for c in d.get("tool_calls", [])) == without_ids(
        answer.get("tool_calls", [])), raw
    assert finish == ("length" if end == "cut" else "tool_calls" if answer.get("tool_calls") else "stop"), raw


def test_parallel_tool_calls_false_keeps_the_first_call(tmp_path, monkeypatch):
    """parallel_tool_calls false was accepted and ignored: a reply with two calls returned both, where OpenAI's
    semantics allow one. The reply keeps its first call (as vLLM does), unstreamed and streamed alike; true or
    unset keeps them all."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        paris, oslo = {"city": "Paris"}, {"city": "Oslo"}
        reply[0] = (f"Checking both.<|tool_call>call:weather{gemma_value(paris)}<tool_call|>"
                    f"<|tool_call>call:weather{gemma_value(oslo)}<tool_call|>")
        kw = dict(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=200, seed=1)
        one = {"content": "Checking both.", "tool_calls": [("function", "weather", paris)],
               "finish_reason": "tool_calls", "reasoning_content": None}
        for canvas in (0, 3):
            reply[1] = canvas
            assert whole_message(client, parallel_tool_calls=False, **kw) == one
            assert streamed_message(client, parallel_tool_calls=False, **kw) == one
        for extra in ({}, {"parallel_tool_calls": True}):
            assert len(whole_message(client, **extra, **kw)["tool_calls"]) == 2
    finally:
        srv.should_exit = True


def test_a_tool_reply_cut_by_max_tokens_in_a_later_canvas_carries_no_token_past_it(tmp_path, monkeypatch):
    """The reply a response template reads is the row's valid tokens: of each canvas, those past the row's count so
    far up to its num_new_tokens (a canvas's whole width carried its tail past max_tokens into the content). The
    engine is forced as the library streams: full-width canvases, whose tail past the budget is not the answer's,
    and the row answered at the Commit it ends in."""
    import torch
    from test_response import gemma_value

    from blockpress.generate import Commit, Done, GenerationOutput

    base, srv, lm, _ = tool_server(tmp_path, monkeypatch)
    tok, width = lm.tokenizer, 8  # the forced canvas width
    call = f"<|tool_call>call:weather{gemma_value({'city': 'Paris'})}<tool_call|>"
    ids = tok.encode(call + "Here is the weather for you and for all of your friends today.")
    junk = tok.encode("JUNK") * width

    def forced(prompts, max_new_tokens=None, **kwargs):
        b, m = len(prompts), max_new_tokens[0]
        valid = ids[:m]
        for k, start in enumerate(range(0, m, width)):
            n = min(m, start + width)
            text = [tok.decode(valid[:n])] * b
            yield Commit(k, torch.tensor([(valid[start:n] + junk)[:width]] * b), torch.ones(b, dtype=torch.long),
                         torch.full((b,), n == m), 0.0, texts=[tok.decode(valid[start:n])] * b,
                         num_new_tokens=torch.full((b,), n), texts_so_far=text, settled_texts=text,
                         stopped=[False] * b, reused_prompt_tokens=[0] * b, num_chosen_tokens=torch.full((b,), n))
        yield Done(GenerationOutput(
            sequences=torch.tensor([valid] * b), prompt_length=0, texts=[tok.decode(valid)] * b,
            tokens_per_forward=torch.ones(b), forward_passes=torch.ones(b, dtype=torch.long),
            num_new_tokens=torch.full((b,), m), steps_per_canvas=torch.ones(b, 1, dtype=torch.long),
            extra={"stopped": [False] * b, "reused_prompt_tokens": [0] * b}))

    monkeypatch.setattr(lm, "stream", forced)
    called = len(tok.encode(call))
    m = (called // width + 1) * width + 3  # 3 tokens into a canvas after the call's: 5 of it past the budget
    assert width < m < len(ids)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        choice = client.chat.completions.create(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=m,
                                                seed=1).choices[0]
        assert [c.function.name for c in choice.message.tool_calls or []] == ["weather"], choice.message
        assert choice.message.content == tok.decode(ids[called:m]) and choice.finish_reason == "length", choice
    finally:
        srv.should_exit = True


def test_a_reply_that_only_calls_has_null_content(tmp_path, monkeypatch):
    """A reply that is tool calls and nothing else answers content null, as OpenAI's assistant message with
    tool_calls does ("" is what a reply without calls that says nothing gets)."""
    from test_response import gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        reply[0] = f"<|tool_call>call:weather{gemma_value({'city': 'Oslo'})}<tool_call|>"
        choice = client.chat.completions.create(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=200,
                                                seed=1).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert choice.message.content is None, choice.message
    finally:
        srv.should_exit = True


def test_a_response_template_that_backtracks_without_end_answers_as_text(tmp_path, monkeypatch, caplog):
    """A checkpoint's tool-call pattern with nested repeats held the server's event loop (every request, /health
    too) for hours on a malformed call of 40 characters. Its read is refused past its limit (0.05 s a read, 0.2 s a
    request here), and the reply is answered as text, as a reply the template cannot read, with a warning naming
    the pattern; streamed, the chunks add up to that text and end. A well-formed call still reads."""
    from test_response import GEMMA4, NESTED, gemma_value

    import blockpress.serve as serve
    from blockpress.response import PatternBudget

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch)
    hostile = json.loads(json.dumps(GEMMA4))
    hostile["fields"]["tool_calls"]["open_pattern"] = rf"<\|tool_call>call:(?P<name>{NESTED})(?=\{{)"
    lm.tokenizer.response_template = hostile
    monkeypatch.setattr(serve, "PatternBudget", functools.partial(PatternBudget, seconds=0.05, total=0.2))
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=200, seed=1)
    try:
        reply[0] = "Checking.<|tool_call>call:" + "w" * 40 + " {city:Oslo}<tool_call|>"
        text = {"content": lm.tokenizer.decode(lm.tokenizer.encode(reply[0])), "tool_calls": [],
                "finish_reason": "stop", "reasoning_content": None}
        with caplog.at_level("WARNING", logger="blockpress.serve"):
            assert whole_message(client, **kw) == text
        assert any("fields.tool_calls.open_pattern" in r.getMessage() and "RESPONSE_PATTERN_SECONDS" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        for canvas in (0, 4):
            reply[1] = canvas
            assert streamed_message(client, **kw) == text
        reply[0] = f"Checking.<|tool_call>call:weather{gemma_value({'city': 'Oslo'})}<tool_call|>"
        assert whole_message(client, **kw)["tool_calls"] == [("function", "weather", {"city": "Oslo"})]
    finally:
        srv.should_exit = True


def whole_message(client, **kw) -> dict:
    choice = client.chat.completions.create(**kw).choices[0]
    calls = [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    return {"content": choice.message.content or "", "tool_calls": calls, "finish_reason": choice.finish_reason,
            "reasoning_content": (choice.message.model_extra or {}).get("reasoning_content")}


def streamed_message(client, **kw) -> dict:
    """A streamed chat reply joined as OpenAI's clients join it, in whole_message's shape; every call's first chunk
    carries its id, type and name, and a call's id is new to the reply."""
    content, calls, reasoning, finish = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        piece = (delta.model_extra or {}).get("reasoning_content")
        reasoning = reasoning if piece is None else (reasoning or "") + piece
        for t in delta.tool_calls or []:
            if t.index not in calls:
                assert t.id.startswith("call_") and t.type == "function" and t.function.name, t
                assert t.id not in [c["id"] for c in calls.values()]
                calls[t.index] = {"id": t.id, "type": t.type, "name": t.function.name, "arguments": ""}
            calls[t.index]["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "tool_calls": [(c["type"], c["name"], json.loads(c["arguments"]))
                                               for _, c in sorted(calls.items())],
            "finish_reason": finish, "reasoning_content": reasoning}


def test_streamed_tool_calls_add_up_to_the_whole_answer(tmp_path, monkeypatch):
    """A request with tools to a checkpoint with a response template was streamed only at its end: the whole reply
    held, its calls in one chunk. Now its content streams as canvases commit and each call as it is written; the
    chunks, joined, are the whole answer (content, reasoning, calls, finish_reason), whatever the reply and however
    its canvases cut it."""
    from test_response import NAME, VALUE, gemma_value

    base, srv, lm, reply = tool_server(tmp_path, monkeypatch)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)

    @settings(max_examples=40, deadline=None)
    @given(st.one_of(st.just(""), st.sampled_from(["Checking.", "I'll look: ", " <b>Two</b> cities\n", "a < b"])),
           st.booleans(), st.lists(st.tuples(NAME, st.dictionaries(NAME, VALUE, max_size=3)), max_size=3),
           st.sampled_from(["", "<turn|>", "<|tool_response>"]), st.integers(1, 12), st.sampled_from([1, 2]))
    def check(text, thought, calls, end, canvas, n):
        reply[0] = (("<|channel>thought\nLet me think.<channel|>" if thought else "") + text
                    + "".join(f"<|tool_call>call:{name}{gemma_value(args)}<tool_call|>" for name, args in calls) + end)
        reply[1] = canvas
        kw = dict(model=MODEL, messages=TOOL_TURNS[:2], tools=TOOLS, max_tokens=400, seed=1)
        assert streamed_message(client, **kw) == whole_message(client, **kw), reply[0]

    try:
        check()
    finally:
        srv.should_exit = True


def test_a_streamed_reply_sends_its_content_and_each_call_as_soon_as_they_are_written():
    """The content before a call goes out as it settles (short of a tail that may start the call's marker), and a
    call once its closing marker is there, not at the reply's end."""
    from test_response import GEMMA4, gemma_value

    from blockpress.response import PartialReader, compile_template, parse_response
    from blockpress.serve import JobText, Reply, ToolStream

    template = compile_template(GEMMA4)
    reply = Reply([], "chat", MODEL, 1, parse=lambda text: parse_response(template, text),
                  read_partial=lambda: PartialReader(template))
    call = f"<|tool_call>call:weather{gemma_value({'city': 'Oslo'})}<tool_call|>"
    stream, sent = ToolStream(), []
    for raw in ["Checking", "Checking the <|tool_", "Checking the " + call[:12], "Checking the " + call,
                "Checking the " + call + call[:-2]]:
        text = raw.replace("<|tool_call>", "").replace("<tool_call|>", "").replace('<|"|>', "")
        sent.append(stream.settle(reply, JobText(text, raw), []))
    assert sent == [[{"content": "Checking"}], [{"content": " the"}], [],
                    [{"tool_calls": [{"index": 0, "id": stream.calls[0]["id"], "type": "function",
                                      "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}], []]


def test_the_text_a_response_template_reads_keeps_special_tokens_and_is_cut_as_the_answer():
    """The answer's text drops special tokens (a checkpoint's tool-call markers often are); the text parsed for tool
    calls keeps them, but not the end-of-turn token, the healed prefix, or the stop string that ended the row, nor
    what came after it in the last token. A broken response template fails when the app is made."""
    from blockpress.serve import text_with_special_tokens
    from blockpress.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["ab cd ef"] * 4, vocab_size=270)
    eos = tok.eos_ids
    ids = tok.encode(" ab<eos>cd") + tok.encode("ef<end_of_turn>")
    assert text_with_special_tokens(tok, ids, eos, " ", []) == "ab<eos>cdef"
    assert text_with_special_tokens(tok, ids[:-2], eos, "", ["d", "cd"]) == " ab<eos>"
    # a stop string the min_tokens' text held did not end the row: only one ending in its last token did
    ids = tok.encode("cd ab cd")
    assert text_with_special_tokens(tok, ids, eos, "", ["cd"]) == "cd ab "
    lm = load_model("random-tiny", None, "cpu")
    lm.tokenizer.response_template = {"fields": {"content": {}}}
    with pytest.raises(ValueError, match="response_template: needs start_anchor"):
        create_app(lm, MODEL)


def held_together(server, monkeypatch, bodies, first, key, path="/v1/completions"):
    """`bodies` posted to `path` while the engine is held on `first` (a completion), so that they queue and are
    admitted in one round. Returns (their answers, each batch's sorted `key(job)`s, the batches started)."""
    engine = server[1].state.engine

    def post(body, route="/v1/completions"):
        if not body.get("stream"):
            return httpx.post(server[0] + route, json=body, timeout=60).json()
        with httpx.stream("POST", server[0] + route, json=body, timeout=60) as r:  # a stream's answer: its last chunk
            return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")][-1]

    gate, batches, stream = threading.Event(), [], engine._stream

    def gated(batch):  # hold the engine on a first request until the others are queued
        events = stream(batch)  # (Engine.check's calls end here: their streams are never iterated)

        def held():
            batches.append(sorted(key(j) for j in batch))
            gate.wait(30)
            yield from events
        return held()

    monkeypatch.setattr(engine, "_stream", gated)
    before = engine.metrics.counters["batches_total"]
    with cf.ThreadPoolExecutor(len(bodies) + 1) as pool:
        try:
            held = pool.submit(post, first)
            wait_until(lambda: batches, "the first request to start", [held])
            together = [pool.submit(post, body, path) for body in bodies]
            wait_until(lambda: engine.depth() >= len(bodies), f"the {len(bodies)} requests to queue",
                       [held, *together])
        finally:
            gate.set()  # (a wait that failed: the pool's end then waits for no batch held at the gate)
        together = [f.result() for f in together]
        assert "choices" in held.result()
    return together, batches, engine.metrics.counters["batches_total"] - before


def alone_then_batched(server, monkeypatch, bodies, first, key, started=2):
    """Each of `bodies` posted alone, then all of them while the engine is held on `first` (held_together), so that
    they queue and run in `started` - 1 batches (one, by default): each answer batched must be the answer alone.
    Returns (the answers, each batch's sorted `key(job)`s)."""
    alone = [httpx.post(server[0] + "/v1/completions", json=body, timeout=60).json() for body in bodies]
    together, batches, made = held_together(server, monkeypatch, bodies, first, key)
    assert made == started
    for a, t in zip(alone, together):
        assert t["choices"][0]["text"] == a["choices"][0]["text"]
        assert t["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
        assert t["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
        assert t["usage"]["forward_passes"] == a["usage"]["forward_passes"]
    return alone, batches


def test_requests_that_must_not_share_a_batch_answer_as_alone(server, monkeypatch):
    """The engine takes a batch's canvas from its first job: a suffix request (a constrained canvas) batched with
    free ones lost its canvas (its text came back ''). Job.key keeps them apart (found by mutating it: no test
    queued both kinds together)."""
    bodies = [{"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "seed": 1},
              {"model": MODEL, "prompt": "def g(y):", "suffix": "return y", "max_tokens": 8, "seed": 2},
              {"model": MODEL, "prompt": "abc", "max_tokens": 8, "seed": 3}]
    first = {"model": MODEL, "prompt": "z", "max_tokens": 1}
    _, batches = alone_then_batched(server, monkeypatch, bodies, first, lambda j: j.canvas is not None, started=3)
    assert sorted(batches[1:]) == [[False, False], [True]]


def test_token_healing_and_plain_requests_do_not_share_a_batch():
    """The engine takes token_healing from a batch's first job: a healed request batched with a plain one answered
    as the other (found by mutating Job.key; random-tiny's tokenizer heals nothing, so this is blockpress-code)."""
    import contextlib

    lm = load_model("blockpress-code", None, "cpu")
    lm.generation_config = dict(lm.generation_config, max_denoising_steps=4)
    app = create_app(lm, MODEL, prefix_cache_bytes=0)
    base, srv = start_in_background(app)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 8, "seed": 3, "token_healing": heal}
              for p in ("def f(x):\n", "x = 1\n") for heal in (False, True)]
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            alone, batches = alone_then_batched((base, app), monkeypatch, bodies, {"model": MODEL, "prompt": "z",
                                                "max_tokens": 1}, lambda j: j.token_healing, started=3)
        assert alone[0]["choices"][0]["text"] != alone[1]["choices"][0]["text"]  # (healing changes the answer)
        assert sorted(batches[1:]) == [[False, False], [True, True]]
    finally:
        with contextlib.suppress(Exception):
            srv.should_exit = True


def test_waiting_requests_start_no_more_rows_than_max_batch_leaves():
    """Jobs of one key waiting together started as one batch whatever max_batch left (no test queued more than the
    free rows): with max_batch 2 and one row running, three requests start one, then two."""
    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 3, "max_new_tokens": 24}
    app = create_app(lm, MODEL, max_batch=2)
    base, srv = start_in_background(app)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 8, "seed": i} for i, p in enumerate(("abc", "hi", "x"))]
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            together, batches, _ = held_together((base, app), monkeypatch, bodies, {"model": MODEL, "prompt": "z",
                                                 "max_tokens": 1}, lambda j: j.prompt)
    finally:
        srv.should_exit = True
    assert all("choices" in t for t in together)
    assert max(len(b) for b in batches) <= 2 and sorted(len(b) for b in batches[1:]) == [1, 2]


def test_requests_of_different_temperatures_share_a_batch_and_answer_as_alone(server, monkeypatch):
    """Jobs batched only when their whole sampler settings were equal, so a request at temperature 0.7 never shared
    a step with one at 0.8, nor one with a top_p or top_k with one without: concurrent clients ran one batch after
    another. Now each row draws with its own temperature, top_p and top_k, and answers as it would alone."""
    bodies = [{"model": MODEL, "prompt": "abc", "max_tokens": 20, "temperature": 0.5, "seed": 1},
              {"model": MODEL, "prompt": "hello there", "max_tokens": 20, "temperature": 1.3, "top_p": 0.8, "seed": 2},
              {"model": MODEL, "prompt": "x", "max_tokens": 12, "temperature": 0.9, "top_k": 5, "seed": 3}]
    first = {"model": MODEL, "prompt": "z", "max_tokens": 1, "temperature": 2.0}
    alone, batches = alone_then_batched(server, monkeypatch, bodies, first, lambda j: j.sampler.draw_temperature)
    assert batches == [[2.0], [0.5, 0.9, 1.3]]
    assert len({a["choices"][0]["text"] for a in alone}) == len(bodies)  # three answers, not one


def test_requests_of_different_lengths_share_a_batch_and_answer_as_alone(server, monkeypatch):
    """Jobs batched only when their max_tokens and min_tokens were equal, so clients that send different lengths (all
    real ones) ran one by one. Now they share a batch, each row with its own budget, and each answer, finish_reason
    and usage is the request's alone."""
    bodies = [{"model": MODEL, "prompt": "abc", "max_tokens": 5, "min_tokens": 5, "seed": 1},  # ends by its length
              {"model": MODEL, "prompt": "hello there", "max_tokens": 30, "seed": 2},
              {"model": MODEL, "prompt": "x", "max_tokens": 11, "min_tokens": 3, "seed": 3, "stop": ["\n"]}]
    first = {"model": MODEL, "prompt": "z", "max_tokens": 1}
    alone, batches = alone_then_batched(server, monkeypatch, bodies, first, lambda j: j.max_tokens)
    assert batches == [[1], [5, 11, 30]]
    assert alone[0]["choices"][0]["finish_reason"] == "length" and alone[0]["usage"]["completion_tokens"] == 5


def test_a_mixed_batch_passes_drafts_and_eos_only_minimums_per_row(server, monkeypatch):
    """Settings that differ between the rows of one batch reach the library per row: drafts when any row's client
    asked for them (not only when all did), and each row's own eos-only minimum (chat's default min_tokens 1 bans
    only the end of turn; a min_tokens the client sent also holds stop strings back), not the first row's for all."""
    lm = server[1].state.engine.lm
    stream, asked = lm.stream, []

    def recording(prompts, **kwargs):
        eos_only = kwargs["min_new_tokens_eos_only"]
        asked.append((len(prompts), kwargs["drafts"], dict(zip(kwargs["min_new_tokens"], eos_only))
                      if isinstance(eos_only, list) else eos_only))
        return stream(prompts, **kwargs)

    monkeypatch.setattr(lm, "stream", recording)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1}
    bodies = [{**chat, "drafts": True, "stream": True}, {**chat, "seed": 2, "min_tokens": 2}]  # (drafts: streamed)
    answers, batches, made = held_together(server, monkeypatch, bodies, {"model": MODEL, "prompt": "z",
                                           "max_tokens": 1}, lambda j: j.seed, path="/v1/chat/completions")
    assert all("choices" in a for a in answers) and made == 2 and batches[1] == [1, 2], (answers, batches)
    rows = [a for a in asked if a[0] == 2]  # (Engine.check's calls have one row each)
    assert rows == [(2, True, {1: True, 2: False})], asked  # (whichever row came first)


def test_a_batch_that_cannot_allocate_its_cache_runs_its_requests_one_by_one(server, monkeypatch):
    """A batch's cache is its rows x its longest row: one request with a huge max_tokens (here, memory for 200
    positions x rows) failed every request beside it with a 500 and torch's allocator text, though each honest one
    succeeds alone. Nothing was sent yet, so each runs alone: the honest ones answer as alone, and only the one that
    cannot be allocated alone fails, its message naming the cache and max_tokens."""
    from blockpress.cache import KVCache, _allocating

    engine = server[1].state.engine
    allocate, shapes = KVCache.allocate.__func__, []

    def small_device(cls, config, batch_size, capacity, *args, **kwargs):
        shapes.append((batch_size, capacity, len(engine.batches)))  # (and the batches running beside it)
        if batch_size * capacity > 200:
            with _allocating(f"batch_size {batch_size} x capacity {capacity}", batch_size * capacity):
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return allocate(cls, config, batch_size, capacity, *args, **kwargs)

    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 16, "seed": i} for i, p in enumerate(("abc", "hi", "x"))]
    huge = {"model": MODEL, "prompt": "y", "max_tokens": 400, "seed": 9}
    alone = [httpx.post(server[0] + "/v1/completions", json=b, timeout=60).json() for b in bodies]
    monkeypatch.setattr(KVCache, "allocate", classmethod(small_device))
    gate, started, stream = threading.Event(), threading.Event(), engine._stream

    def gated(batch):  # the engine held on a first request until the others are queued, so that they batch
        events = stream(batch)

        def held():
            started.set()
            gate.wait(30)
            yield from events
        return held()

    monkeypatch.setattr(engine, "_stream", gated)
    with cf.ThreadPoolExecutor(5) as pool:
        first = pool.submit(httpx.post, server[0] + "/v1/completions",
                            json={"model": MODEL, "prompt": "z", "max_tokens": 1}, timeout=60)
        assert started.wait(30), "the first request did not start"
        together = [pool.submit(httpx.post, server[0] + "/v1/completions", json=b, timeout=60)
                    for b in [*bodies, huge]]
        wait_until(lambda: engine.depth() >= 4, "the 4 requests to queue", [first, *together])
        gate.set()
        together = [f.result() for f in together]
        assert first.result().status_code == 200
    assert any(b == 4 for b, _, _ in shapes)  # (they did batch, and that batch failed)
    after = shapes[[b for b, _, _ in shapes].index(4) + 1:]
    assert len(after) == 4 and all(b == 1 and running == 1 for b, _, running in after)  # one by one, nothing beside
    assert [r.status_code for r in together] == [200, 200, 200, 500], [r.text for r in together]
    assert [r.json()["choices"][0]["text"] for r in together[:3]] == [a["choices"][0]["text"] for a in alone]
    message = together[3].json()["error"]["message"]
    assert "KVCache: batch_size 1 x capacity" in message and "max_tokens" in message, message


def test_requests_of_a_batch_that_could_not_allocate_keep_their_place_ahead_of_later_ones(server, monkeypatch):
    """A batch that cannot allocate its cache puts its requests back at the head of the queue, each to run alone:
    they came first, so they run before a request that came after them (put at the tail, they waited behind it)."""
    from blockpress.cache import KVCache, _allocating

    engine = server[1].state.engine
    monkeypatch.setattr(engine, "max_batch", 4)  # the batch of four leaves no row for the later request
    allocate, order = KVCache.allocate.__func__, []

    def small_device(cls, config, batch_size, capacity, *args, **kwargs):
        if batch_size * capacity > 200:
            with _allocating(f"batch_size {batch_size} x capacity {capacity}", batch_size * capacity):
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return allocate(cls, config, batch_size, capacity, *args, **kwargs)

    monkeypatch.setattr(KVCache, "allocate", classmethod(small_device))
    gate, started, stream = threading.Event(), threading.Event(), engine._stream

    def gated(batch):  # the engine held on a first request until the others are queued; each batch's seeds noted
        events = stream(batch)

        def held():
            order.append([j.seed for j in batch])
            started.set()
            gate.wait(30)
            yield from events
        return held()

    monkeypatch.setattr(engine, "_stream", gated)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 4, "seed": i} for i, p in enumerate(("abc", "hi", "x"))]
    huge = {"model": MODEL, "prompt": "y", "max_tokens": 400, "seed": 9}
    later = {"model": MODEL, "prompt": "w", "max_tokens": 4, "seed": 7, "token_healing": True}  # (another Job.key)
    with cf.ThreadPoolExecutor(6) as pool:
        first = pool.submit(httpx.post, server[0] + "/v1/completions",
                            json={"model": MODEL, "prompt": "z", "max_tokens": 1, "seed": 5}, timeout=60)
        assert started.wait(30), "the first request did not start"
        together = [pool.submit(httpx.post, server[0] + "/v1/completions", json=b, timeout=60)
                    for b in [*bodies, huge]]
        wait_until(lambda: engine.depth() >= 4, "the 4 requests to queue", [first, *together])
        after = pool.submit(httpx.post, server[0] + "/v1/completions", json=later, timeout=60)
        wait_until(lambda: engine.depth() >= 5, "the later request to queue", [first, *together, after])
        gate.set()
        assert [f.result().status_code for f in together] == [200, 200, 200, 500]
        assert after.result().status_code == 200 and first.result().status_code == 200
    assert order[0] == [5] and sorted(order[1]) == [0, 1, 2, 9], order  # they did batch; the later one waited
    assert order[2:] == [[seed] for seed in order[1]] + [[7]], order  # then each alone, in its place, then it


@pytest.mark.parametrize("mode", ["plain", "stream", "suffix"])
def test_a_row_that_ends_is_answered_before_its_batch_does(mode):
    """A row's answer (its finish_reason and usage, a stream's last chunk and [DONE]) went out only when its batch's
    longest row ended: a 16-token answer batched beside a 480-token one came 28.6 s late. It goes out at the commit
    its row ends in now, and is what it is alone (a fill-in-the-middle row too, its usage its hole's tokens)."""
    from blockpress.generate import Commit, Done

    lm = load_model("random-tiny", None, "cpu")  # a server of its own: no other test's batch shares its engine
    lm.generation_config = {"max_denoising_steps": 3}
    app = create_app(lm, MODEL, max_batch=8, prefix_cache_bytes=0)
    base, srv = start_in_background(app)
    engine = app.state.engine
    long = {"model": MODEL, "prompt": "a", "max_tokens": 64, "min_tokens": 64, "seed": 1}  # 8 canvases, no early end
    short = {"model": MODEL, "prompt": "b", "max_tokens": 4, "min_tokens": 4, "seed": 2, "stream": mode == "stream"}
    if mode == "suffix":  # canvas requests batch apart from free ones: both are
        long, short = {**long, "suffix": "z"}, {**short, "suffix": "y"}
        del long["min_tokens"], short["min_tokens"]

    def post(body):
        if not body.get("stream"):
            return httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        return {"choices": [{"text": "".join(c["choices"][0]["text"] for c in chunks),
                             "finish_reason": chunks[-1]["choices"][0]["finish_reason"]}]}

    try:
        alone = post(short)
        held, gate, answered, order, streams = threading.Event(), threading.Event(), threading.Event(), [], engine._stream

        def watched(batch):
            events = streams(batch)
            both = sorted(j.max_tokens for j in batch) == [4, 64]

            def run():
                held.set()
                gate.wait(60)  # the first request's batch is held until both others are queued: they share one
                for event in events:
                    if isinstance(event, Done) and both:
                        order.append("batch done")
                    yield event
                    if isinstance(event, Commit) and both and bool(event.finished.any()):
                        answered.wait(60)  # the short row has ended: its answer goes out while the long one runs on
            return run()

        engine._stream = watched
        with cf.ThreadPoolExecutor(3) as pool:
            first = pool.submit(post, {"model": MODEL, "prompt": "z", "max_tokens": 1})
            assert held.wait(60)  # the engine is inside the first batch: what comes now waits together
            futures = [pool.submit(post, body) for body in (long, short)]
            futures[1].add_done_callback(lambda f: (order.append("short answered"), answered.set()))
            wait_until(lambda: engine.depth() >= 2, "the long and the short request to queue", [first, *futures])
            gate.set()
            got = [f.result() for f in futures]
            first.result()
        deadline = time.monotonic() + 30  # the long answer goes out at its last commit, just before the batch's Done
        while len(order) < 2 and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert order == ["short answered", "batch done"]
        assert got[1]["choices"][0]["text"] == alone["choices"][0]["text"]
        assert got[1]["choices"][0]["finish_reason"] == alone["choices"][0]["finish_reason"]
        if mode != "stream":
            assert got[1]["usage"] == alone["usage"] and got[0]["usage"]["completion_tokens"] == 64
    finally:
        srv.should_exit = True


def stop_ending_first(base, ends_first, other):
    """A stop string early in prompt `ends_first`'s greedy 24-token answer that `other`'s never holds: batched with
    it, that row ends first."""
    def alone(prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "min_tokens": 24, "temperature": 0}
        return httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    first, rest = alone(ends_first), alone(other)
    return next(first[i:i + 3] for i in range(1, len(first) - 3) if first[i:i + 3] not in rest)


def test_a_choice_that_ends_gets_no_chunk_after_its_last(server):
    """Answering a row at the commit it ends in left Batch.draft sending it the batch's drafts: a streamed choice got
    draft chunks after its finish_reason chunk while the request's other choice ran on."""
    base, prompts = server[0], ["abc", "hello there"]
    stop = stop_ending_first(base, *prompts)
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 24, "min_tokens": 0, "temperature": 0, "stop": [stop],
            "stream": True, "drafts": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    ends = {c["choices"][0]["index"]: n for n, c in enumerate(chunks) if c["choices"][0]["finish_reason"]}
    assert sorted(ends) == [0, 1] and ends[0] < ends[1] - 1  # the first choice did end before the other
    assert not [n for n, c in enumerate(chunks) if c["choices"][0]["index"] == 0 and n > ends[0]]


def test_choices_come_in_index_order_whichever_row_ends_first(server):
    """A whole answer lists its choices by index, as OpenAI's does, whichever row ended first: in the order the rows
    ended, the second prompt's answer came as choices[0]."""
    base, prompts = server[0], ["hello there", "abc"]
    stop = stop_ending_first(base, prompts[1], prompts[0])  # the second row ends first
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 24, "min_tokens": 0, "temperature": 0, "stop": [stop]}
    choices = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"]
    assert [(c["index"], c["finish_reason"]) for c in choices] == [(0, "length"), (1, "stop")], choices


def test_a_short_request_is_answered_while_a_long_one_runs():
    """A batch ran to its end before the engine looked at the queue again, so a 4-token request sent while a
    600-token one ran waited for all of it (52 s), free rows or not. Now running batches take turns a canvas at a time
    and a request that arrives starts at the next canvas, in a batch of its own: the short answer is done long
    before the long one, and each is what it is alone."""
    from blockpress.generate import Commit, Done

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2}
    app = create_app(lm, MODEL, max_batch=4, prefix_cache_bytes=0)  # (a cached prompt moves logits by rounding)
    base, srv = start_in_background(app)
    engine = app.state.engine
    long = {"model": MODEL, "prompt": "a", "max_tokens": 96, "min_tokens": 96, "seed": 1}  # 6 canvases, no early end
    short = {"model": MODEL, "prompt": "b", "max_tokens": 4, "seed": 2}
    try:
        alone = [httpx.post(base + "/v1/completions", json=body, timeout=60).json() for body in (long, short)]
        done, stream = [], engine._stream

        def watched(batch):  # note which batch ends first; hold the long one after its first canvas until the short
            events = stream(batch)  # one is queued, so that the short one surely arrives while it runs

            def run():
                for event in events:
                    if isinstance(event, Done):
                        done.append(batch[0].max_tokens)
                    yield event
                    if isinstance(event, Commit) and event.canvas_index == 0 and batch[0].max_tokens == 96:
                        deadline = time.monotonic() + 30
                        while not engine.depth() and time.monotonic() < deadline:
                            time.sleep(0.01)
            return run()

        engine._stream = watched
        with cf.ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", base + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                lines = r.iter_lines()
                first = next(x for x in lines if x.startswith("data: "))  # its first canvas is in
                answer = pool.submit(httpx.post, base + "/v1/completions", json=short, timeout=60)
                chunks = [first] + [x for x in lines if x.startswith("data: ")]
            assert answer.result().json()["choices"] == alone[1]["choices"]
        assert chunks[-1] == "data: [DONE]"
        assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in chunks[:-1]) == alone[0]["choices"][0]["text"]
        deadline = time.monotonic() + 30  # the long answer goes out at its last commit, just before its batch's Done
        while len(done) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == [4, 96]  # before: [96, 4], the short one waiting for every canvas of the long one
    finally:
        srv.should_exit = True


KEY = "sk-test-4f9a"


@pytest.fixture(scope="module")
def keyed_server():
    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 3, "max_new_tokens": 16}
    base, srv = start_in_background(create_app(lm, MODEL, api_key=KEY, allowed_origins=["http://localhost:3000"]))
    yield base
    srv.should_exit = True


def test_an_api_key_is_required_of_v1_requests_and_health_stays_open(keyed_server):
    """Anyone who reached the port could use the model: with api_key, a /v1 request without `Authorization: Bearer
    <key>` (what the openai client sends its api_key as) gets a 401 in OpenAI's shape, as vLLM's --api-key; streamed
    requests too, before any chunk; an unknown route, another model's name or a bad body as well, so a stranger
    learns nothing of the server; /health stays open for probes."""
    base = keyed_server
    for key in ("none", KEY + "x", KEY[:-1]):
        stranger = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            stranger.models.list()
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
        assert key not in caught.value.body["message"]  # the guess is not echoed
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    for path, body in (("/v1/nowhere", {}), ("/v1/completions", {"model": "other", "prompt": "x"}),
                       ("/v1/completions", {"prompt": 5})):
        answer = httpx.post(base + path, json=body)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", answer.text
        assert answer.json()["error"]["message"].startswith("no API key provided")
    assert httpx.get(base + "/health").status_code == 200
    colleague = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in colleague.models.list().data] == [MODEL]
    kw = dict(model=MODEL, prompt="abc", max_tokens=16, seed=3)
    whole = colleague.completions.create(**kw).choices[0].text
    assert "".join(c.choices[0].text for c in colleague.completions.create(stream=True, **kw)) == whole
    wrong_model = httpx.post(base + "/v1/completions", json={"model": "other", "prompt": "x"},
                             headers={"Authorization": f"bearer {KEY}"})  # the scheme is case-insensitive
    assert wrong_model.status_code == 404  # past the key, the request's own errors, as before


def test_v1_itself_asks_for_the_key_and_a_look_alike_path_does_not(keyed_server):
    """`/v1` is the API as `/v1/...` is: a stranger gets the 401 there, not the 404 that tells an unknown route
    (it was left open); `/v1x` is no part of the API (its own 404, no key asked)."""
    for method in ("GET", "POST"):
        answer = httpx.request(method, keyed_server + "/v1")
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", answer.text
        assert answer.headers["www-authenticate"] == "Bearer"
    answer = httpx.get(keyed_server + "/v1", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_url", answer.text
    assert httpx.get(keyed_server + "/v1x").status_code == 404


def test_the_key_is_required_of_an_app_mounted_in_another_or_served_under_a_root_path():
    """The key check matched "/v1/" against the whole path: mounted as docs/serving.md shows
    (host.mount("/llm", app)) or under uvicorn's --root-path, Starlette keeps the prefix in the path ("/llm/v1/...")
    and routes on what follows it, so every /v1 request was served without the key."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    host = FastAPI()
    host.mount("/llm", create_app(lm, MODEL, api_key=KEY, prefix_cache_bytes=0))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with TestClient(host) as http:
        stranger = http.post("/llm/v1/completions", json=body)
        assert stranger.status_code == 401 and stranger.json()["error"]["code"] == "invalid_api_key", stranger.text
        assert http.post("/llm/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert http.get("/llm/health").status_code == 200  # (still open)
    with TestClient(create_app(lm, MODEL, api_key=KEY, prefix_cache_bytes=0), root_path="/llm") as http:
        # (what uvicorn --root-path /llm hands the app: the path with its prefix, and the root_path)
        assert http.get("/llm/v1/models").status_code == 401
        assert http.get("/llm/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with TestClient(create_app(lm, MODEL, api_key=KEY, prefix_cache_bytes=0), root_path="/v") as http:
        # a root that is a prefix of the route's own first word ("/v" of "/v1/models", uvicorn --root-path /v over a
        # request for 1/models): Starlette strips a root only at a "/", so /v1/models is what runs, and asks the key
        assert http.get("/v1/models").status_code == 401
        assert http.post("/v1/completions", json=body).status_code == 401


def test_the_key_may_follow_its_scheme_after_several_spaces(keyed_server):
    """RFC 7235's credentials are `auth-scheme 1*SP token`: the key after `Bearer` and two or more spaces is the key
    (a 401 for it would refuse a client that pads the header), and a key with a character more is not."""
    for header in (f"Bearer {KEY}", f"Bearer  {KEY}", f"bearer   {KEY}"):
        assert httpx.get(keyed_server + "/v1/models", headers={"Authorization": header}).status_code == 200, header
    assert httpx.get(keyed_server + "/v1/models", headers={"Authorization": f"Bearer  {KEY}x"}).status_code == 401


def test_a_browser_page_can_send_the_key_and_read_its_401(keyed_server):
    """A browser's preflight never carries the key: it must pass (and allow the Authorization header), and a 401
    must carry the CORS header, or the page sees a network error in place of the reason."""
    origin = "http://localhost:3000"
    preflight = httpx.options(keyed_server + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and "authorization" in preflight.headers["access-control-allow-headers"].lower()
    refused = httpx.get(keyed_server + "/v1/models", headers={"Origin": origin})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin


def test_a_page_may_read_retry_after(keyed_server):
    """A 429 says in Retry-After when to try again, and a browser hides from a page every header CORS does not
    expose: the server's answers expose it to the origins allowed."""
    r = httpx.get(keyed_server + "/v1/models", headers={"Origin": "http://localhost:3000",
                                                         "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "retry-after" in r.headers.get("access-control-expose-headers", "").lower(), r.headers


@pytest.mark.parametrize("key", ["", " sk", "sk\n", "clé", 5])
def test_a_key_no_client_could_send_is_refused_without_showing_it(key):
    with pytest.raises(ValueError, match="api_key: expected a non-empty key of printable ASCII") as caught:
        create_app(load_model("random-tiny", None, "cpu"), MODEL, api_key=key)
    assert not key or str(key) not in str(caught.value)


def test_the_models_routes_answer_head_as_get_and_keep_the_key():
    """HEAD /v1/models and /v1/models/{id} answered 405 (Allow: GET) while HEAD /health answered 200: a load balancer
    or uptime probe that sends HEAD to the models route marked the server down."""
    from fastapi.openapi.utils import get_openapi
    from fastapi.testclient import TestClient

    lm = load_model("random-tiny", None, "cpu")
    with TestClient(create_app(lm, MODEL, prefix_cache_bytes=0, api_key="sekret")) as http:
        key = {"Authorization": "Bearer sekret"}
        for path in ("/v1/models", f"/v1/models/{MODEL}", "/v1/models/nope"):
            got, head = http.get(path, headers=key), http.head(path, headers=key)
            assert head.status_code == got.status_code != 405, (path, head.status_code)
            assert head.headers["content-type"] == got.headers["content-type"]
            assert head.headers["content-length"] == got.headers["content-length"] and head.content == b""
            assert http.head(path).status_code == 401  # the key is asked for, as GET asks for it
        schema = get_openapi(title=http.app.title, version=http.app.version, routes=http.app.routes)
        assert set(schema["paths"]["/v1/models"]) == {"get"}
        assert set(schema["paths"]["/v1/models/{model_id}"]) == {"get"}


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGHUP"), reason="no SIGHUP on Windows")
def test_a_sighup_lets_requests_in_flight_finish_as_sigterm_does():
    """A SIGHUP (the terminal closed: an ssh session that dropped) killed `blockpress serve` where it stood: the
    request in flight got no answer ("Server disconnected without sending a response", 0.06 s after the signal). It
    now stops as a SIGTERM does, the request finishing in the grace period; the exit status is still SIGHUP's."""
    import re
    import signal
    import subprocess
    import sys

    # SIGHUP at its default in the server, as a terminal's shell starts it: under `nohup pytest` it inherited the
    # signal ignored (left so by serve, on purpose), and this test waited 60 s for a server that went on serving.
    proc = subprocess.Popen([sys.executable, "-m", "blockpress.cli", "serve", "--model", "random-tiny", "--port", "0",
                             "--threads", "1"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        said = ""
        while (m := re.search(r"serving .* on (http://\S+/v1)", said)) is None:
            line = proc.stderr.readline()
            assert line, said
            said += line
        body = {"model": "random-tiny", "prompt": "x", "max_tokens": 64, "min_tokens": 64, "seed": 1}
        with cf.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, m.group(1) + "/completions", json=body, timeout=120)
            time.sleep(1.0)  # the request is in flight
            proc.send_signal(signal.SIGHUP)
            r = answer.result()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64
        assert proc.wait(timeout=60) == -signal.SIGHUP
        assert "blockpress: stopping; requests in flight get up to 30 s to finish" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_create_app_works_out_token_healings_texts_before_the_first_request():
    """Every `suffix` or `template` canvas is healed (and a `token_healing` completion), which matches on each id's text
    decoded alone and on the texts a longer one starts with: worked out by the first such request, they held it (and
    the engine thread behind it) for seconds at 262,144 tokens. create_app works them out, as the longest token."""
    lm = load_model("random-tiny", None, "cpu")
    assert lm.tokenizer._token_texts is None and lm.tokenizer._extendable is None  # a fresh tokenizer
    create_app(lm, MODEL, prefix_cache_bytes=0)
    assert lm.tokenizer._token_texts is not None and lm.tokenizer._extendable is not None


def test_create_app_is_hinted_with_the_model_it_takes():
    """create_app(lm: Any) told an editor nothing of what to pass and a type checker passed create_app("model-path"),
    which fails inside with "'str' object has no attribute 'tokenizer'": its hint is blockpress.LM, resolvable at
    run time (FastAPI-style introspection included)."""
    import typing

    import blockpress

    assert typing.get_type_hints(create_app)["lm"] is blockpress.LM


@pytest.mark.parametrize("function, positional", [("blockpress.serve.create_app", ["lm", "model_name"]),
                                                  ("blockpress.checkpoint.save_model", ["model", "path", "passthrough"]),
                                                  ("blockpress.data.parse_examples", ["obj", "tokenizer", "where"]),
                                                  ("blockpress.train.StepBatches", ["source", "cfg"]),
                                                  ("blockpress.train.save_adapter",
                                                   ["model", "path", "rank", "alpha", "base"]),
                                                  ("blockpress.response.Field", []),
                                                  ("blockpress.checkpoint.ModelPlan", []),
                                                  ("blockpress.lm.LM", ["model", "tokenizer", "generation_config"])])
def test_a_helpers_options_after_what_it_works_on_are_keywords(function, positional):
    """create_app's nine server options, save_model's five, parse_examples' four, StepBatches' sizes and token ids
    and save_adapter's quantize are keywords: as positions (parse_examples and StepBatches were called with seven,
    create_app took eleven) two ints, two strs or two Nones side by side swap unseen. A response template's compiled
    Field takes its sixteen fields by name alone (pairs of open and close markers, texts, heads, leads), a load's
    ModelPlan its twelve (two dtypes, two name sets); an LM what a load adds past the generation config (its path
    and adapter's path side by side)."""
    import importlib
    import inspect

    module, name = function.rsplit(".", 1)
    parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters.values()
    assert [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert all(p.kind is p.KEYWORD_ONLY for p in parameters if p.name not in positional)


@pytest.mark.parametrize("max_batch, batches, eos_first", [(8, [1, 1, 2, 2], False), (1, [1, 1], False),
                                                      (8, [1, 1, 2, 2], True)])
def test_warm_up_runs_a_row_alone_and_two_rows_over_two_canvases_before_the_engine_starts(max_batch, batches,
                                                                                          eos_first):
    """serve --compile / --cuda-graphs warm the app up (serve.warm_up) before the engine thread starts: each batch
    of WARM_UP_PROMPTS as a request's jobs run, over two canvases (the cache grows between them: under torch.compile
    that recompiled once as dynamic, which the first client waited for), the two-row ones only where max_batch takes
    them. Nothing is counted, the prefix cache is left empty, and once the engine has started it is refused (the
    engine thread owns the model). A model whose first choice is EOS (eos_first) still runs two canvases: a row
    that ended in its first left the second unwarmed."""
    from fastapi.testclient import TestClient

    from blockpress.generate import StepFunctions, denoise_step
    from blockpress.serve import WARM_UP_PROMPTS, warm_up

    lm = load_model("random-tiny", None, "cpu")
    lm.generation_config = {"max_denoising_steps": 2, "max_new_tokens": 4}
    passes = []  # (cache, rows, its length, thread) of each decoder pass: a batch's cache is its own

    def denoise(canvas_ids, cache, **kw):
        passes.append((cache, canvas_ids.shape[0], cache.length, threading.current_thread().name))
        logits = lm.model.denoise(canvas_ids, cache, **kw)
        if eos_first:
            logits[..., lm.config.text.eos_token_ids[0]] = 1e4
        return logits

    lm.step_functions = StepFunctions(denoise, denoise_step, lm.model.encode)
    app = create_app(lm, MODEL, max_batch=max_batch)
    warm_up(app)
    engine = app.state.engine
    assert engine.thread.ident is None and {p[-1] for p in passes} == {threading.current_thread().name}
    # each batch's rows, and its passes over two canvases: the cache's length changes once within each batch
    runs: list[list[tuple[int, int]]] = []
    for i, (cache, rows, length, _) in enumerate(passes):
        if i == 0 or cache is not passes[i - 1][0]:
            runs.append([])
        runs[-1].append((rows, length))
    assert [run[0][0] for run in runs] == batches == [len(p) for p in WARM_UP_PROMPTS if len(p) <= max_batch]
    assert all(len({length for _, length in run}) == 2 for run in runs)
    assert len(engine.prefix_cache) == 0 and engine.metrics.counters["batches_total"] == 0
    with TestClient(app) as http:
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}).status_code == 200
        with pytest.raises(ValueError, match="warm_up: the engine thread has started"):
            warm_up(app)


def test_chat_template_kwargs_reach_the_template_over_the_servers_defaults(server, monkeypatch):
    """vLLM's chat_template_kwargs ({"enable_thinking": true} for Gemma 4) were refused as an unknown field: a client
    could not turn a template's thinking on. The request's win over the server's defaults, name by name."""
    lm, state = server[1].state.engine.lm, server[1].state.server
    monkeypatch.setattr(lm.tokenizer, "chat_template",
                        "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}THINKING{% endif %}")

    def prompt_tokens(**extra):
        r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens()
    marker = len(lm.tokenizer.encode("THINKING"))
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain + marker
    assert prompt_tokens(chat_template_kwargs={"unread": [1, {"a": None}]}) == plain  # a variable it never reads
    monkeypatch.setitem(state.template_defaults, "enable_thinking", True)
    assert prompt_tokens() == plain + marker
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == plain
    # jinja's own globals too: {"namespace": 1} replaced the template's namespace(...), a 500 ("'int' object is not
    # callable"), and --chat-template-kwargs '{"namespace": 1}' made every chat request one
    for bad, words in (({"messages": []}, "'messages' is set by the chat rendering itself"),
                       ({"raise_exception": 1}, "reserved"), ({"not a name": 1}, "not a template variable's name"),
                       *(({name: 1}, f"'{name}' is set by the chat rendering itself")
                         for name in ("namespace", "range", "dict", "cycler", "joiner", "lipsum"))):
        r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": bad})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "chat_template_kwargs" and words in error["message"], r.text
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["enable_thinking"]})
    assert r.status_code == 400 and "chat_template_kwargs" in r.text
    for name in ("tools", "namespace"):
        with pytest.raises(ValueError, match=rf"^chat_template_kwargs: '{name}' is set by the chat rendering itself"):
            create_app(lm, MODEL, chat_template_kwargs={name: []})


def test_a_chat_with_several_mistakes_is_refused_for_the_first_in_its_order(server, monkeypatch):
    """A chat request's refusals come in one order: its messages, then its chat_template_kwargs, then the model's
    lack of a chat template; each fixed brings the next to light (for the split of create_app's chat route)."""
    lm = server[1].state.engine.lm
    monkeypatch.setattr(lm.tokenizer, "chat_template", None)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "reasoning_content": "hmm"}],
            "chat_template_kwargs": {"raise_exception": 1}}
    fixes = [{"messages": [{"role": "user", "content": "hi"}]}, {"chat_template_kwargs": {}}]
    for param, words in (("messages[0].reasoning_content", "only an assistant message has a thought"),
                         ("chat_template_kwargs", "reserved"), ("messages", "no chat template")):
        r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and words in error["message"], r.text
        body.update(fixes.pop(0) if fixes else {})


def test_create_app_given_several_mistakes_names_the_first_in_its_order():
    """create_app's refusals come in one order, each fixed bringing the next to light: the model's tokenizer, the
    prefix cache's size, the model's default steps, the counts, max_context, max_body_bytes, the origins, the key,
    the chat-template variables; with all fixed the app is made (for the split of create_app's checks)."""
    lm = load_model("random-tiny", None, "cpu")
    tokenizer, lm.tokenizer = lm.tokenizer, None
    lm.generation_config = {"max_denoising_steps": 10**9}
    kw = dict(prefix_cache_bytes=-1, max_queue=0, max_batch=0, max_stops=0, max_context=0, max_body_bytes=0,
              allowed_origins="http://localhost", api_key=" key", chat_template_kwargs={"tools": []})
    steps = [(r"^serve: the model has no tokenizer", lambda: setattr(lm, "tokenizer", tokenizer)),
             (r"^prefix_cache_bytes: ", lambda: kw.update(prefix_cache_bytes=0)),
             (r"^serve: the model's default max_denoising_steps", lambda: setattr(lm, "generation_config", {})),
             (r"^max_queue: ", lambda: kw.update(max_queue=4)),
             (r"^max_batch: ", lambda: kw.update(max_batch=2)),
             (r"^max_stops: ", lambda: kw.update(max_stops=2)),
             (r"^max_context: ", lambda: kw.update(max_context=None)),
             (r"^max_body_bytes: ", lambda: kw.update(max_body_bytes=None)),
             (r"^allowed_origins: ", lambda: kw.update(allowed_origins=["http://localhost"])),
             (r"^api_key: ", lambda: kw.update(api_key="key")),
             (r"^chat_template_kwargs: ", lambda: kw.update(chat_template_kwargs=None))]
    for message, fix in steps:
        with pytest.raises(ValueError, match=message):
            create_app(lm, MODEL, **kw)
        fix()
    assert create_app(lm, MODEL, **kw).state.server.context == lm.config.text.max_position_embeddings


def test_a_cancelled_batch_adds_to_metrics_only_what_its_unanswered_rows_did():
    """/metrics' completion_tokens_total and forward_passes_total take an answered row's work when it is answered; a
    batch then cancelled (its last client left) adds its other rows' work, not the answered rows' a second time."""
    from types import SimpleNamespace

    from blockpress.generate import Cancelled

    added: dict[str, int] = {}
    batch = Batch.__new__(Batch)  # (its stream stood for by the one event under test)
    batch.engine = SimpleNamespace(metrics=SimpleNamespace(
        add=lambda **kw: [added.__setitem__(k, added.get(k, 0) + v) for k, v in kw.items()]))
    batch.answered = [True, False]
    batch.events = iter([Cancelled(forward_passes=torch.tensor([30, 7]), num_new_tokens=torch.tensor([100, 16]))])
    batch.advance()
    assert added == {"completion_tokens_total": 16, "forward_passes_total": 7}
