"""Server mode: a running server measured the way its clients see it, through concurrent
streaming chat completions (time to first token, inter-token and inter-chunk latency). A client
only (httpx): no HTTP server code here.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..bench_prompts import PROMPT_SETS, BenchPrompt, select_prompts
from .schema import Percentiles, Pooled, RequestResult, ServerReport, now, pooled


@dataclass
class _Stream:
    """What one streamed request saw, with times relative to sending it."""

    prompt: str
    status: Optional[int] = None
    error: Optional[str] = None
    chunk_times: list[float] = field(default_factory=list)
    seconds: float = 0.0
    usage: Optional[dict] = None
    finish_reason: Optional[str] = None
    dflash: Optional[dict] = None
    done: bool = False


def _openai_body(prompt: BenchPrompt, model: str, max_tokens: int, temperature: float) -> dict:
    body = {"model": model, "messages": prompt.messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if prompt.tools:
        body["tools"] = prompt.tools
    return body


def stream_request(client, base: str, body: dict, prompt: str, headers: dict, timeout: float) -> _Stream:
    out = _Stream(prompt)
    start = time.perf_counter()
    try:
        with client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    continue
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
                        out.chunk_times.append(time.perf_counter() - start)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                        out.dflash = event.get("dflash", out.dflash)
                if event.get("usage"):
                    out.usage = event["usage"]
        if out.error is None and not out.done:
            out.error = "the stream ended without [DONE]"
        elif out.error is None and out.usage is None:
            out.error = "no usage chunk (stream_options.include_usage was sent)"
    except Exception as e:  # a benchmark counts failures instead of stopping at the first
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.perf_counter() - start
    return out


def percentiles(values: Sequence[float]) -> Percentiles:
    if not values:
        return Percentiles(count=0, mean=None, p50=None, p90=None, p99=None)
    import numpy as np

    p50, p90, p99 = (float(v) for v in np.percentile(np.asarray(values, dtype=float), [50, 90, 99]))
    return Percentiles(count=len(values), mean=float(np.mean(values)), p50=p50, p90=p90, p99=p99)


def _inter_token(s: _Stream) -> Optional[float]:
    tokens = (s.usage or {}).get("completion_tokens") or 0
    if s.error or tokens < 2 or len(s.chunk_times) < 2:
        return None
    return (s.chunk_times[-1] - s.chunk_times[0]) / (tokens - 1)


def _cached(s: _Stream) -> Optional[int]:
    return ((s.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def server_model(client, base: str, headers: dict) -> str:
    import httpx

    try:
        response = client.get(base + "/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{base}: no OpenAI-compatible server with a model answers there ({e})") from None


def run_server_bench(url: str, *, concurrency: int, requests: int, model: Optional[str] = None,
                     sets: Optional[list[str]] = None, prompts_per_set: Optional[int] = None,
                     max_tokens: int = 256, temperature: float = 0.0, api_key: Optional[str] = None,
                     timeout: float = 600.0, warmup: int = 1, progress: bool = True) -> ServerReport:
    import httpx
    from tqdm import tqdm

    if concurrency < 1 or requests < 1:
        raise ValueError("--concurrency and --requests must be at least 1")
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = select_prompts(sets, prompts_per_set)
    with httpx.Client() as client:
        model = model or server_model(client, base, headers)
        for i in range(warmup):  # alone and not measured: the first requests compile kernels
            p = prompts[i % len(prompts)]
            stream_request(client, base, _openai_body(p, model, min(max_tokens, 16), temperature), p.name, headers,
                           timeout)

    # N clients, each with its own connection, take the next request number until none is left.
    streams: list[Optional[_Stream]] = [None] * requests
    lock, counter = threading.Lock(), iter(range(requests))
    bar = tqdm(total=requests, desc="dflash bench --server", unit="req", disable=not progress, file=sys.stderr)

    def client_loop(client):
        with client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                p = prompts[i % len(prompts)]
                streams[i] = stream_request(client, base, _openai_body(p, model, max_tokens, temperature),
                                            f"{p.set}/{p.name}", headers, timeout)
                with lock:
                    bar.update()

    # Made before the clock starts: an httpx client (its TLS context) takes tens of ms of CPU to make.
    clients = [httpx.Client() for _ in range(concurrency)]
    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    bar.close()

    done = [s for s in streams if s is not None]
    ok = [s for s in done if s.error is None]
    inter_token = [v for v in (_inter_token(s) for s in ok) if v is not None]
    gaps = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    spec = [s.dflash for s in ok if s.dflash and s.dflash.get("speculative")]
    counts = pooled(Pooled(d.get("cycles", 0), d.get("draft_tokens_accepted", 0), d.get("accepted_by_position") or [])
                    for d in spec)
    completion = sum((s.usage or {}).get("completion_tokens", 0) for s in ok)
    return ServerReport(
        created=now(), url=base, model=model, concurrency=concurrency, requests=requests, max_tokens=max_tokens,
        temperature=temperature, sets=list(sets or PROMPT_SETS), completed=len(ok), errors=len(done) - len(ok),
        error_messages=list(dict.fromkeys(s.error for s in done if s.error))[:10], wall_seconds=wall,
        prompt_tokens=sum((s.usage or {}).get("prompt_tokens", 0) for s in ok),
        cached_prompt_tokens=sum(_cached(s) or 0 for s in ok), completion_tokens=completion,
        throughput_tokens_per_second=completion / wall if wall > 0 else 0.0,
        ttft_seconds=percentiles([s.chunk_times[0] for s in ok if s.chunk_times]),
        inter_token_seconds=percentiles(inter_token), inter_chunk_seconds=percentiles(gaps),
        request_decode_tokens_per_second=percentiles([1 / v for v in inter_token if v > 0]),
        speculative_requests=len(spec), tokens_per_cycle=counts.tokens_per_cycle,
        acceptance_by_position=counts.acceptance_by_position,
        requests_detail=[
            RequestResult(prompt=s.prompt, ok=s.error is None, error=s.error, status=s.status, seconds=s.seconds,
                          ttft_seconds=s.chunk_times[0] if s.chunk_times else None, chunks=len(s.chunk_times),
                          prompt_tokens=(s.usage or {}).get("prompt_tokens"), cached_tokens=_cached(s),
                          completion_tokens=(s.usage or {}).get("completion_tokens"),
                          finish_reason=s.finish_reason, dflash=s.dflash)
            for s in done
        ],
    )
