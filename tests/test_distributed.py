"""A target sharded over two local processes (MLX's ring backend over 127.0.0.1), the same
lossless loop on both: output token for token equal to one process's, for every family that shards;
the server end to end on rank 0; a rank that dies makes rank 0 fail its requests and exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash_core.loading import load_engine, load_target, parameter_bytes
from dflash_core.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHARDED = ["qwen3", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4"]
N_TOKENS, SHORT = 144, 48  # as tests/distributed_rank.py


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _pythonpath() -> str:
    """This checkout first, then whatever the caller had (a device's MLX, say)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def _start_ranks(tmp_path, command: list[str], size: int = 2, env: dict | None = None) -> list[subprocess.Popen]:
    """`command` on `size` ranks, as `mlx.launch --backend ring` starts them on one host."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(size)]))
    procs = []
    for rank in range(size):
        rank_env = {**os.environ, **(env or {}), "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank),
                    "PYTHONPATH": _pythonpath()}
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    return procs


def _wait(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes


@pytest.fixture(scope="module")
def two_rank_results(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed")
    pairs = [f"{f}={','.join(str(p) for p in request.getfixturevalue(f'{f}_pair'))}" for f in SHARDED]
    # The stacked-projections run (test_stacked_projections_over_sharded_weights) in the same ranks.
    pairs.append(f"qwen3_5:stacked={','.join(str(p) for p in request.getfixturevalue('qwen3_5_pair'))}")
    out = tmp / "results.json"
    procs = _start_ranks(tmp, [sys.executable, str(HERE / "distributed_rank.py"), str(out), *pairs])
    codes = _wait(procs, timeout=300)
    logs = "\n".join((tmp / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    return ranks


def test_stacked_projections_over_sharded_weights(two_rank_results, qwen3_5_pair):
    """The CUDA path's stacked projections (run here on the CPU) multiply each rank's slices of
    Qwen3.5's linear-attention projections, which mlx-lm shards in place: still lossless, and still
    what one process decodes."""
    got, other = (rank["qwen3_5:stacked"] for rank in two_rank_results)
    assert got == other
    assert got["stacked_groups"] > 0
    single = load_engine(str(qwen3_5_pair[0]), str(qwen3_5_pair[1]), prefill_chunk=16)
    alone = _tokens(single, speculative=False)
    assert got["alone"] == got["every_acceptance_length"] == alone
    assert got["random_drafter_on"] == alone[:SHORT]


def test_generate_on_two_ranks_prints_once_what_one_process_prints(qwen3_pair, tmp_path):
    generate = [sys.executable, "-c", "import sys; from dflash_core.cli import main; sys.exit(main())", "generate",
                "--target", str(qwen3_pair[0]), "--drafter", str(qwen3_pair[1]), "--prompt", "The fox",
                "--max-tokens", "24", "--temperature", "0.8", "--seed", "5", "--json"]
    procs = _start_ranks(tmp_path, generate + ["--distributed"])
    assert _wait(procs, timeout=300) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    printed = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    two_ranks = [json.loads(line) for line in printed[0].splitlines() if line.startswith("{")]
    assert len(two_ranks) == 1 and not any(line.startswith("{") for line in printed[1].splitlines())
    one = subprocess.run(generate, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": _pythonpath()})
    assert one.returncode == 0, one.stderr
    single = json.loads(one.stdout.strip().splitlines()[-1])
    assert two_ranks[0]["token_ids"] == single["token_ids"] and len(single["token_ids"]) > 0


def test_bench_on_two_ranks_reports_once_with_outputs_matching(qwen3_pair, tmp_path):
    out = tmp_path / "bench.json"
    bench = [sys.executable, "-c", "import sys; from dflash_core.cli import main; sys.exit(main())", "bench",
             "--distributed", "--target", str(qwen3_pair[0]), "--drafter", str(qwen3_pair[1]), "--contexts", "160",
             "--sets", "chat", "--prompts-per-set", "1", "--max-tokens", "12", "--repeats", "1", "--cooldown", "0",
             "--no-plots", "--no-progress", "--out", str(out)]
    procs = _start_ranks(tmp_path, bench)
    assert _wait(procs, timeout=300) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    report = json.loads(out.read_text())  # rank 0's; the other rank writes nothing
    assert report["all_matched"] is True
    assert "results:" not in (tmp_path / "rank1.log").read_text()


def _tokens(engine, n: int = N_TOKENS, **kwargs):
    prompt = list(range(5, 45))
    return [t for c in engine.generate(prompt, max_tokens=n, stop_token_ids=set(), **kwargs) for t in c.token_ids]


@pytest.mark.parametrize("family", SHARDED)
def test_two_ranks_give_what_one_process_gives(two_rank_results, request, family):
    rank0, rank1 = two_rank_results
    assert rank0["size"] == 2
    got, other = rank0[family], rank1[family]
    assert {k: v for k, v in got.items() if k != "target_bytes"} == {k: v for k, v in other.items() if k != "target_bytes"}
    target, drafter = request.getfixturevalue(f"{family}_pair")
    single = load_engine(str(target), str(drafter), prefill_chunk=16)
    alone = _tokens(single, speculative=False)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    # Sharded, every path is lossless against the sharded target alone, and the sharded target
    # decodes what one process decodes.
    assert got["alone"] == alone
    assert got["every_acceptance_length"] == alone
    assert got["random_drafter_on"] == got["random_drafter_auto"] == alone[:SHORT]
    assert got["seeded_alone"] == got["seeded_on"] == _tokens(single, SHORT, speculative=False, sampling=seeded)
    assert len(got["unseeded"]) == SHORT
    # Each rank holds about half of the target: the sharded projections split, the embedding
    # (and tied or split LM head) and the norms stay whole.
    whole = parameter_bytes(load_target(target)[0].model)
    assert got["target_bytes"] < 0.8 * whole and other["target_bytes"] < 0.8 * whole


def test_heads_that_do_not_split_evenly_say_so(tiny_pair_factory):
    from dflash_core.sharding import shard_target

    class Group:
        def size(self):
            return 3

    gemma = load_target(tiny_pair_factory("gemma3_text")[0])[0]
    with pytest.raises(ValueError, match="4 attention heads cannot be split evenly over 3 ranks"):
        shard_target(gemma.model, Group())


# ---------------------------------------------------------------- the server, rank 0 talking
@contextlib.contextmanager
def _serve(tmp_path, pair):
    """`dflash serve --distributed` on two ranks, healthy: (its URL, the ranks' processes); the
    ranks still running at the end are killed."""
    (port,) = _free_ports(1)
    config = tmp_path / "config.yaml"
    config.write_text("prefix_cache_gb: 0.05\nserver:\n  distributed_step_timeout: 5\n  shutdown_timeout: 10\n")
    dflash = [sys.executable, "-c", "import sys; from dflash_core.cli import main; sys.exit(main())"]
    procs = _start_ranks(tmp_path, dflash + ["serve", "--distributed", "--config", str(config), "--target", str(pair[0]),
                                             "--drafter", str(pair[1]), "--name", "tiny", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        _healthy(url, procs)
        yield url, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _healthy(url: str, procs, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a rank exited during start-up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the distributed server did not become healthy")


def _chat(max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say something about foxes."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


def _one_process_answer(pair) -> str:
    from live_server import LiveServer

    from dflash_core.settings import ModelSettings, Settings

    settings = Settings(prefix_cache_gb=0.05, models=[ModelSettings(name="tiny", target=str(pair[0]), drafter=str(pair[1]))])
    with LiveServer(settings) as live:
        reply = httpx.post(live.url + "/v1/chat/completions", json=_chat(24), timeout=60).json()
    return reply["choices"][0]["message"]["content"]


def test_server_on_rank_0_chats_streams_cancels_and_stops_cleanly(qwen3_5_pair, tmp_path):
    with _serve(tmp_path, qwen3_5_pair) as (url, procs):
        first = httpx.post(url + "/v1/chat/completions", json=_chat(24), timeout=60).json()
        answer = first["choices"][0]["message"]["content"]
        assert first["usage"]["completion_tokens"] > 0 and first["dflash"]["speculative"]
        assert answer == _one_process_answer(qwen3_5_pair)
        # Streamed, the same greedy answer.
        text = ""
        with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(24, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text += delta.get("content") or ""
        assert text == answer
        # A client that goes away mid-stream: its generation ends on both ranks, the next request
        # is served as if nothing happened.
        with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(400, stream=True), timeout=60) as r:
            for _ in zip(range(3), r.iter_lines()):
                pass
        again = httpx.post(url + "/v1/chat/completions", json=_chat(24), timeout=60).json()
        assert again["choices"][0]["message"]["content"] == answer
        # SIGTERM to rank 0: it drains, tells rank 1 to finish; both exit 0.
        procs[0].send_signal(signal.SIGTERM)
        assert _wait(procs, timeout=60) == [0, 0], (tmp_path / "rank1.log").read_text()[-2000:]


def test_a_rank_that_dies_fails_rank_0s_requests_and_rank_0_exits(qwen3_5_pair, tmp_path):
    with _serve(tmp_path, qwen3_5_pair) as (url, procs):
        with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(4000, stream=True), timeout=60) as r:
            lines = r.iter_lines()
            for _ in zip(range(3), lines):
                pass
            procs[1].kill()  # rank 1 dies mid-generation
            rest = "\n".join(lines)
        assert "distributed group cannot go on" in rest
        assert _wait(procs[:1], timeout=60) == [1]  # rank 0 stops, saying why, rather than hang
        assert "distributed group cannot go on" in (tmp_path / "rank0.log").read_text()


def test_a_step_that_waits_too_long_breaks_the_group():
    """The watch counts the group as broken when a step waits on the other ranks past its timeout
    (a rank killed mid-forward can leave MLX's ring waiting instead of raising)."""
    import threading

    import mlx.core as mx

    from dflash_core.distributed import Channel, GroupFailed

    reasons = []
    told = threading.Event()
    channel = Channel(mx.distributed.init(), on_failure=lambda reason: reasons.append(reason) or told.set())
    channel.watch(timeout=0.2)
    assert not told.wait(0.5)  # idle between steps: nothing to wait on, nothing happens
    with channel.busy():
        assert told.wait(10)
    assert "no answer from the other ranks for 0.2 s" in reasons[0] and channel.failure == reasons[0]
    with pytest.raises(GroupFailed):  # nothing more goes through a broken group
        channel.number(1)


def test_a_request_travels_to_the_other_ranks_whole():
    from dflash_core.distributed import request_arguments, request_message
    from dflash_core.grammar import GrammarSpec

    kwargs = {"max_tokens": 9, "sampling": SamplingParams(temperature=0.5, seed=4, logit_bias={17: -2.5}),
              "stop_token_ids": {3, 1}, "logprobs": 2, "speculation": "on",
              "grammar": GrammarSpec(kind="regex", value="[a-z]+"), "reasoning_budget": (5, 12)}
    message = json.loads(json.dumps(request_message([4, 5, 6], kwargs)))  # what the wire carries
    prompt, back = request_arguments(message)
    assert prompt == [4, 5, 6] and back == kwargs


def test_rank_0_prices_its_batched_auto_rows_by_their_rounds(qwen3_pair):
    """Rank 0 serves every generation in batched rounds, so its `auto` rows are priced by their
    shares of a round (rounds.py), as one process's batch is: two rows together record no wall time
    between their own reads (a round's wall is not one row's step), where rows judging by those
    walls, as alone, would."""
    import mlx.core as mx

    from dflash_core.batching import generate_together
    from dflash_core.distributed import Channel, LeaderEngine

    target, drafter = qwen3_pair
    prompt = list(range(5, 40))
    requests = [{"prompt_tokens": prompt, "max_tokens": 24, "stop_token_ids": set(), "speculation": "auto"}] * 2
    leader = LeaderEngine(load_engine(str(target), str(drafter), prefill_chunk=16), Channel(mx.distributed.init()))
    generate_together(leader, requests, max_rows=2)
    timings = leader.speculation_state.timings
    assert leader.speculation_state.rounds.coefficients() is not None  # the rounds were timed
    assert all(timings.count(w) == 0 for w in [0, *leader.speculation_state.policy("auto").widths])
    # The same two rows as alone (the policy before this was fixed): their walls are recorded.
    alone = load_engine(str(target), str(drafter), prefill_chunk=16)
    state = alone.speculation_state
    generate_together(alone, [{**r, "speculation": state.policy("auto")} for r in requests], max_rows=2)
    assert sum(state.timings.count(w) for w in [0, *state.policy("auto").widths]) > 0
