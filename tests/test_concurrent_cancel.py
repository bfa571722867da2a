"""Many clients at once over all four generation APIs, some walking away mid-stream, against one
server that batches them with speculation on (the hybrid Qwen3.5 pair: its GatedDeltaNet states
roll back per row). Every request that runs to its end gets exactly what it gets alone, token for
token, greedy and seeded; the walked-away ones free their rows without disturbing the others; and
afterwards the server is idle and still gives every request its solo answer (no cancelled row left
a cache, a prefix-cache entry or a drafter context behind that changes anyone's output). The same
holds for agent conversations reusing prefixes, and for two models that take turns in a memory
budget that holds one."""

from __future__ import annotations

import concurrent.futures
import logging
import random
import re
import time
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer

from dflash_core.settings import ModelSettings, ServerSettings, Settings

KEY = "sk-concurrent"
# Rows of different lengths and budgets, on every API; chat and completions also sample with a seed
# (the Responses and Messages APIs have no seed field).
PROMPTS = ["The river ran", "Numbers: 1 2 3 4", "def add(a, b):", "Once upon a time there was",
           "A list of colours:", "The quick brown fox", "Dear diary, today", "SELECT * FROM"]


@dataclass(frozen=True)
class Request:
    api: str  # "completions", "chat", "responses" or "messages"
    prompt: str
    max_tokens: int
    seed: int | None = None  # None: greedy

    @property
    def temperature(self) -> float:
        return 0.0 if self.seed is None else 0.9


APIS = ("completions", "chat", "responses", "messages")


def _requests() -> list[Request]:
    out = []
    for i, prompt in enumerate(PROMPTS * 2):
        api = APIS[i % 4]
        seed = 100 + i if api in ("completions", "chat") and i % 3 == 0 else None
        out.append(Request(api, prompt, max_tokens=24 + 7 * (i % 5), seed=seed))
    return out


REQUESTS = _requests()  # each runs to its end
# Clients that walk away after a few pieces: two on each API, budgets long enough that they are
# still generating then.
QUITTERS = [Request(api, prompt, max_tokens=300, seed=7 if api == "chat" and k else None)
            for k, prompt in enumerate(PROMPTS[:2]) for api in APIS]


@pytest.fixture(scope="module")
def live(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    served = Settings(server=ServerSettings(api_key=KEY, max_active=8),
                      models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512,
                                            speculation="on")])
    with LiveServer(served) as server:
        yield server


@pytest.fixture(scope="module")
def clients(live):
    return (openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=120))


def _extra(r: Request) -> dict:
    return {} if r.seed is None else {"seed": r.seed}


def whole(clients, r: Request) -> tuple[str, str]:
    """The request answered whole: (its reasoning, its answer)."""
    oa, an = clients
    if r.api == "completions":
        return "", oa.completions.create(model="tiny", prompt=r.prompt, max_tokens=r.max_tokens,
                                         temperature=r.temperature, **_extra(r)).choices[0].text
    if r.api == "chat":
        message = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": r.prompt}],
                                             max_tokens=r.max_tokens, temperature=r.temperature,
                                             **_extra(r)).choices[0].message
        return getattr(message, "reasoning_content", None) or "", message.content
    if r.api == "responses":
        out = oa.responses.create(model="tiny", input=r.prompt, max_output_tokens=r.max_tokens,
                                  temperature=r.temperature)
        reasoning = "".join(c.text for item in out.output if item.type == "reasoning" for c in item.content or ())
        return reasoning, out.output_text
    # (The SDK no longer takes sampling arguments: the body's field, as the API has it.)
    message = an.messages.create(model="tiny", messages=[{"role": "user", "content": r.prompt}],
                                 max_tokens=r.max_tokens, extra_body={"temperature": r.temperature})
    return ("".join(block.thinking for block in message.content if block.type == "thinking"),
            "".join(block.text for block in message.content if block.type == "text"))


def _pieces(clients, r: Request):
    """The request streamed: (its stream, to close; an iterator of (reasoning, answer) pieces, one
    per event, empty where the event carries neither)."""
    oa, an = clients
    if r.api == "completions":
        s = oa.completions.create(model="tiny", prompt=r.prompt, max_tokens=r.max_tokens, temperature=r.temperature,
                                  stream=True, **_extra(r))
        return s, (("", c.choices[0].text) for c in s if c.choices)
    if r.api == "chat":
        s = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": r.prompt}],
                                       max_tokens=r.max_tokens, temperature=r.temperature, stream=True, **_extra(r))
        return s, ((getattr(c.choices[0].delta, "reasoning_content", None) or "", c.choices[0].delta.content or "")
                   for c in s if c.choices)
    if r.api == "responses":
        s = oa.responses.create(model="tiny", input=r.prompt, max_output_tokens=r.max_tokens,
                                temperature=r.temperature, stream=True)
        return s, ((e.delta if e.type == "response.reasoning_text.delta" else "",
                    e.delta if e.type == "response.output_text.delta" else "") for e in s)
    s = an.messages.create(model="tiny", messages=[{"role": "user", "content": r.prompt}], max_tokens=r.max_tokens,
                           extra_body={"temperature": r.temperature}, stream=True)
    return s, ((e.delta.thinking if e.type == "content_block_delta" and e.delta.type == "thinking_delta" else "",
                e.delta.text if e.type == "content_block_delta" and e.delta.type == "text_delta" else "")
               for e in s)


def streamed(clients, r: Request, quit_after: int | None) -> tuple[str, str] | None:
    """The request streamed: (its reasoning, its answer); or, with `quit_after`, the client closes
    the connection after that many pieces of output (the tiny model thinks first on the chat APIs:
    reasoning counts) and None is returned."""
    stream, pieces = _pieces(clients, r)
    reasoning, answer, seen = [], [], 0
    try:
        for thought, text in pieces:
            reasoning.append(thought)
            answer.append(text)
            seen += bool(thought or text)
            if quit_after is not None and seen >= quit_after:
                return None
    finally:
        stream.close()
    assert quit_after is None, f"{r}: the stream ended before the client meant to quit"
    return "".join(reasoning), "".join(answer)


def _wait_idle(live, seconds=30) -> None:
    """Until the worker holds no generation (a closed stream is noticed at the row's next turn)."""
    scheduler = live.state.scheduler
    deadline = time.monotonic() + seconds
    while not scheduler.idle and time.monotonic() < deadline:
        time.sleep(0.02)
    assert scheduler.idle, f"{scheduler.active} active, {scheduler.waiting} waiting after every client left"


def _cancelled(live) -> dict[str, float]:
    metrics = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = re.findall(r'^dflash_cancelled_requests_total\{endpoint="(\w+)"\} (\S+)$', metrics, re.M)
    return {endpoint: float(count) for endpoint, count in found}


def test_concurrent_clients_that_quit_change_no_one_elses_tokens(live, clients):
    solo = [whole(clients, r) for r in REQUESTS]
    assert len(set(solo)) > len(PROMPTS) // 2, "the solo answers should differ by prompt and budget"
    rng = random.Random(7)
    cancelled = _cancelled(live)
    rounds = 3
    for _ in range(rounds):  # the quitters come at other places in the queue and quit after other counts
        jobs = [(r, None) for r in REQUESTS] + [(r, rng.randint(1, 4)) for r in QUITTERS]
        rng.shuffle(jobs)
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            done = dict(zip(jobs, pool.map(lambda job: streamed(clients, *job), jobs)))
        for r, alone in zip(REQUESTS, solo):
            assert done[(r, None)] == alone, f"{r}: streamed beside others {done[(r, None)]!r}, alone {alone!r}"
        _wait_idle(live)
    # Each quitter's generation was stopped as a cancel, on every API.
    now = _cancelled(live)
    assert {api: now.get(api, 0) - cancelled.get(api, 0) for api in APIS} == {api: 2 * rounds for api in APIS}
    # Whole and streamed answers at once, nobody quitting.
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        both = list(pool.map(lambda ir: whole(clients, ir[1]) if ir[0] % 2 else streamed(clients, ir[1], None),
                             enumerate(REQUESTS)))
    assert both == solo
    _wait_idle(live)
    # And one at a time again: what the quitters left behind changed nothing.
    assert [whole(clients, r) for r in REQUESTS] == solo


# ------------------------------------------------------------- agent conversations, turn on turn

SYSTEM = "You are a careful assistant. Answer briefly. " * 4  # shared by every conversation: one snapshot
TOPICS = ["rivers", "prime numbers", "sorting a list", "colours of the sea", "the fox", "a diary"]


def _turns(clients, api: str, topic: str, turns: int = 3) -> list[tuple[str, str]]:
    """One conversation: each turn sends the whole history so far (the system prompt, every user
    message and every earlier answer) and a new question, as an agent loop does; its answers."""
    oa, an = clients
    history, answers = [], []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn} about {topic}: say more."})
        if api == "chat":
            message = oa.chat.completions.create(model="tiny", messages=[{"role": "system", "content": SYSTEM}, *history],
                                                 max_tokens=20 + 3 * turn, temperature=0).choices[0].message
            reasoning, text = getattr(message, "reasoning_content", None) or "", message.content or ""
        else:
            message = an.messages.create(model="tiny", system=SYSTEM, messages=history, max_tokens=20 + 3 * turn,
                                         extra_body={"temperature": 0})
            reasoning = "".join(b.thinking for b in message.content if b.type == "thinking")
            text = "".join(b.text for b in message.content if b.type == "text")
        answers.append((reasoning, text))
        history.append({"role": "assistant", "content": text or reasoning})
    return answers


def test_concurrent_agent_conversations_reuse_prefixes_and_match_a_cold_server(live, clients, qwen3_5_pair):
    target, drafter = qwen3_5_pair
    conversations = [("chat" if i % 2 else "messages", topic) for i, topic in enumerate(TOPICS)]
    # The reference: one conversation at a time on a server that neither batches nor caches prefixes.
    cold = Settings(server=ServerSettings(api_key=KEY, batching=False), prefix_cache_gb=0,
                    models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512,
                                          speculation="on")])
    with LiveServer(cold) as server:
        cold_clients = (openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120),
                        anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120))
        reference = [_turns(cold_clients, api, topic) for api, topic in conversations]
    hits = _prefix_hits(live)
    # All conversations at once on the batching, caching server, with clients quitting around them.
    rng = random.Random(11)
    quitters = [(r, rng.randint(1, 4)) for r in QUITTERS]
    with concurrent.futures.ThreadPoolExecutor(len(conversations) + len(quitters)) as pool:
        talks = [pool.submit(_turns, clients, api, topic) for api, topic in conversations]
        quits = [pool.submit(streamed, clients, *q) for q in quitters]
        assert [talk.result() for talk in talks] == reference
        assert [q.result() for q in quits] == [None] * len(quitters)
    _wait_idle(live)
    # Later turns started from snapshots of earlier ones (and the shared system prompt).
    assert _prefix_hits(live) - hits >= 2 * len(conversations)


def _prefix_hits(live) -> float:
    metrics = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(re.search(r"^dflash_prefix_cache_hits_total (\S+)$", metrics, re.M).group(1))


# ------------------------------------------------------ two models, room for one, clients on both

def test_two_models_with_room_for_one_serve_concurrent_clients_exactly(qwen3_5_pair, gemma4_pair, caplog):
    """A memory budget that holds one model: requests for the other load it, unloading the first
    once no request uses it. Clients of both at once, some quitting: loads and unloads happen
    between their generations, never under one, and each finished request is its solo answer."""
    served = Settings(server=ServerSettings(api_key=KEY), memory_budget_gb=0.002,  # one tiny pair is ~1.3 MB
                      models=[ModelSettings(name=name, target=str(pair[0]), drafter=str(pair[1]), max_context=512,
                                            speculation="on")
                              for name, pair in (("a", qwen3_5_pair), ("b", gemma4_pair))])
    caplog.set_level(logging.INFO, logger="dflash_server.models")
    with LiveServer(served) as server:
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

        def ask(model: str, prompt: str, quit_after: int | None = None):
            stream = oa.completions.create(model=model, prompt=prompt, max_tokens=300 if quit_after else 30,
                                           temperature=0, stream=True)
            text = []
            with stream:
                for chunk in stream:
                    text.append(chunk.choices[0].text if chunk.choices else "")
                    if quit_after is not None and len(text) >= quit_after:
                        return None
            return "".join(text)

        asks = [(model, prompt) for prompt in PROMPTS[:4] for model in ("a", "b")]
        solo = [ask(*a) for a in asks]  # one at a time: every request loads the other model
        assert _unloads(caplog) >= len(asks) - 1
        rng = random.Random(3)
        for _ in range(2):
            jobs = [(*a, None) for a in asks] + [(model, "Go on", rng.randint(1, 3)) for model in ("a", "b", "a", "b")]
            rng.shuffle(jobs)
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                done = dict(zip(jobs, pool.map(lambda job: ask(*job), jobs)))
            assert [done[(*a, None)] for a in asks] == solo
            assert all(done[job] is None for job in jobs if job[2] is not None)
            _wait_idle(server)
        assert not [s for _, _, s in server.statuses if s >= 500]
        assert [ask(*a) for a in asks] == solo


def _unloads(caplog) -> int:
    return sum("unloading" in r.getMessage() for r in caplog.records)
