"""A target sharded over `mlx.core.distributed`: the same lossless loop on every rank.

Every rank holds 1/N of the target (tensor parallelism, sharding.py: mlx-lm's own `model.shard`,
or ours in its pattern for Gemma; the layers all-reduce their outputs, so every rank sees the same
hidden states and logits) and a whole copy of the drafter, and runs the same engine loop on the
same tokens. What must not differ between ranks, or their collectives would stop matching, is
decided once, by rank 0, and handed to the others over the group itself (`Channel`, an all-sum of
bytes only rank 0 fills; no transport of our own): sampling seeds, the `auto` policy's choice of
each step (it times this machine), and, when serving, which generations start, step and end
(`LeaderEngine` on rank 0, `follow` on the others).
Everything else is deterministic given those: the same logits give the same acceptances, the same
prefix-cache hits (its accounting is by nominal bytes here, not by what each allocator handed out)
and the same prefill chunks (fixed size; paced chunks time the machine).

A rank that leaves (its process dies, its link drops) makes the collectives of the others fail
(MLX raises; `mlx.launch` also stops the other ranks): rank 0 then fails every request with
`GroupFailed` and stops, the others exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx

from .sampling import SamplingParams

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """The distributed group broke (a rank left, a collective failed): nothing can run any more."""


def init_group(backend: str = "any") -> mx.distributed.Group:
    """The group this process was started in (`mlx.launch`, or MLX_HOSTFILE and MLX_RANK), with
    at least two ranks: a group of one means the launch did not set one up, which is a mistake."""
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() < 2:
        raise RuntimeError("--distributed needs at least two ranks: start it with `mlx.launch -n 2 ...` "
                           "or a hostfile (docs/distributed.md)")
    return group


def _failed(e: BaseException) -> GroupFailed:
    return GroupFailed(f"the distributed group cannot go on ({type(e).__name__}: {e}): a rank left, its link "
                       "dropped or a step failed; every rank stops")


class Channel:
    """Rank 0's word to the other ranks, carried by the group's own collectives: both sides call
    the same method at the same point of the same program; rank 0's value comes back everywhere."""

    def __init__(self, group: mx.distributed.Group, on_failure: Optional[Callable[[str], None]] = None):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.failure: Optional[str] = None  # why the group broke, once it has
        self.on_failure = on_failure  # told once, with the reason (the server stops)
        self._busy_since: Optional[float] = None  # when the step in flight started (`busy`)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def fail(self, e: BaseException) -> GroupFailed:
        """Mark the group broken (a collective failed, or the ranks can no longer agree)."""
        if self.failure is None:
            self.failure = str(e if isinstance(e, GroupFailed) else _failed(e))
            log.error("%s", self.failure)
            if self.on_failure is not None:
                self.on_failure(self.failure)
        return GroupFailed(self.failure)

    @contextlib.contextmanager
    def busy(self):
        """A step that needs the other ranks: `watch` measures how long it waits on them."""
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def watch(self, timeout: float) -> threading.Thread:
        """Count the group as broken when a step has waited `timeout` seconds. A rank that dies in
        the middle of a forward can leave MLX's ring waiting for good instead of raising (seen on
        this project's CPU when a rank is killed mid-generation), and only a clock can tell."""

        def run():
            while self.failure is None:
                since = self._busy_since
                if since is not None and time.monotonic() - since > timeout:
                    self.fail(GroupFailed(f"the distributed group cannot go on: no answer from the other ranks for "
                                          f"{timeout:g} s (a rank left, hangs, or its link dropped); every rank stops"))
                    return
                time.sleep(min(1.0, timeout / 4))  # a watchdog's tick, not a race being papered over

        thread = threading.Thread(target=run, name="dflash-group-watch", daemon=True)
        thread.start()
        return thread

    def _sum(self, x: mx.array) -> mx.array:
        if self.failure:
            raise GroupFailed(self.failure)
        try:
            y = mx.distributed.all_sum(x, group=self.group)
            mx.eval(y)
        except RuntimeError as e:
            raise self.fail(e) from e
        return y

    def number(self, value: int = 0) -> int:
        """Rank 0's `value` (an int64) on every rank."""
        mine = value if self.leader else 0
        return int(self._sum(mx.array([mine], dtype=mx.int64)).item())

    def message(self, obj: Any = None) -> Any:
        """Rank 0's JSON-able `obj` on every rank (two collectives: its length, then its bytes)."""
        data = json.dumps(obj).encode() if self.leader else b""
        n = self.number(len(data))
        buf = mx.array(list(data), dtype=mx.uint8) if self.leader else mx.zeros((n,), dtype=mx.uint8)
        received = bytes(self._sum(buf).tolist())
        return obj if self.leader else json.loads(received)


class AnnouncedPolicy:
    """Rank 0's speculation policy: its choice of each step goes to the other ranks."""

    def __init__(self, policy, channel: Channel):
        self.policy, self.channel = policy, channel
        self.name = getattr(policy, "name", "auto")

    def plan(self, context: int) -> int:
        return self.channel.number(self.policy.plan(context))

    def observe(self, width: int, context: int, seconds: Optional[float], accepted: int) -> None:
        self.policy.observe(width, context, seconds, accepted)

    def note(self) -> Optional[str]:
        return self.policy.note()


class FollowedPolicy:
    """The other ranks' policy: each step as rank 0 chose it."""

    name = "auto"

    def __init__(self, channel: Channel):
        self.channel = channel

    def plan(self, context: int) -> int:
        return self.channel.number()

    def observe(self, width: int, context: int, seconds: Optional[float], accepted: int) -> None:
        pass

    def note(self) -> Optional[str]:
        return None


def _needs_announcing(engine, kwargs: dict) -> bool:
    """Whether this generation's steps are chosen by timing (`auto` with a drafter)."""
    if engine.drafter is None or kwargs.get("speculative") is False:
        return False
    return (kwargs.get("speculation") or engine.speculation) == "auto"


def _auto_policy(engine, channel: Channel, batched: bool):
    """`auto`'s policy on this rank: rank 0 chooses and announces, the others follow. `batched`:
    the generation runs in batched rounds, which price its steps (speculation.py)."""
    if channel.leader:
        return AnnouncedPolicy(engine.speculation_state.policy("auto", batched), channel)
    return FollowedPolicy(channel)


def _with_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    return sampling if sampling.greedy or sampling.seed is not None else replace(sampling, seed=seed)


class LockstepEngine:
    """An engine every rank drives with the same calls (`dflash generate`, `dflash bench`): each
    generation's seed and `auto` steps come from rank 0."""

    def __init__(self, engine, channel: Channel):
        self.engine, self.channel = engine, channel

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_tokens, **kwargs):
        sampling = kwargs.get("sampling", SamplingParams())
        if not sampling.greedy and sampling.seed is None:
            kwargs["sampling"] = _with_seed(sampling, self.channel.number(secrets.randbits(62)))
        if _needs_announcing(self.engine, kwargs):
            kwargs["speculation"] = _auto_policy(self.engine, self.channel, kwargs.get("batched", False))
        return self.engine.generate(prompt_tokens, **kwargs)


# ------------------------------------------------------------------ serving: rank 0 leads
def request_message(prompt_tokens, kwargs: dict) -> dict:
    """A generation's arguments as rank 0 sends them (JSON: sets and tuples become lists)."""
    out: dict = {"prompt_tokens": list(prompt_tokens)}
    for key, value in kwargs.items():
        if key == "sampling":
            value = asdict(value)
            if value.get("logit_bias"):
                value["logit_bias"] = [[int(t), float(b)] for t, b in value["logit_bias"].items()]
        elif key == "grammar" and value is not None:
            spec = getattr(value, "spec", value)  # a CompiledGrammar travels as its spec
            value = asdict(spec)
        elif key == "stop_token_ids" and value is not None:
            value = sorted(value)
        elif key == "speculation" and not (value is None or isinstance(value, str)):
            raise ValueError("a custom speculation policy cannot be served over several ranks")
        out[key] = value
    return out


def request_arguments(message: dict) -> tuple[list, dict]:
    """`request_message` back into `Engine.generate`'s arguments."""
    from .grammar import GrammarSpec

    kwargs = dict(message)
    prompt = kwargs.pop("prompt_tokens")
    if "sampling" in kwargs:
        sampling = dict(kwargs["sampling"])
        if sampling.get("logit_bias"):
            sampling["logit_bias"] = {int(t): b for t, b in sampling["logit_bias"]}
        kwargs["sampling"] = SamplingParams(**sampling)
    if kwargs.get("grammar") is not None:
        kwargs["grammar"] = GrammarSpec(**kwargs["grammar"])
    if kwargs.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = set(kwargs["stop_token_ids"])
    if kwargs.get("reasoning_budget") is not None:
        kwargs["reasoning_budget"] = tuple(kwargs["reasoning_budget"])
    return prompt, kwargs


@dataclass
class MirroredStream:
    """A generation on rank 0 whose start, steps and end the other ranks repeat."""

    id: int
    stream: Iterator[Any]
    owner: "LeaderEngine"

    def __iter__(self):
        return self

    def __next__(self):
        raise TypeError("a distributed generation only runs through step_together")

    def send(self, value):
        return self.stream.send(value)

    def close(self) -> None:
        self.owner.events.append(["close", self.id])
        self.stream.close()


@dataclass
class LeaderEngine:
    """Rank 0's engine when serving: every batched generation it starts and every step it takes is
    first announced to the other ranks (`follow`), in order. Generations only run batched
    (`batching.step_together`, which hands its streams here)."""

    engine: Any
    channel: Channel
    events: list = field(default_factory=list)  # since the last step: ["open", id, request] / ["close", id]
    _next_id: int = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_tokens, *, batched: bool = False, **kwargs):
        if not batched:
            raise ValueError("a distributed engine steps its generations together (batched=True)")
        if self.channel.failure:
            raise GroupFailed(self.channel.failure)
        sampling = kwargs.get("sampling", SamplingParams())
        kwargs["sampling"] = _with_seed(sampling, secrets.randbits(62))
        message = request_message(prompt_tokens, kwargs)  # before the policy: followers make their own
        if _needs_announcing(self.engine, kwargs):
            kwargs["speculation"] = _auto_policy(self.engine, self.channel, batched=True)
            message["speculation"] = "followed"
        stream = self.engine.generate(prompt_tokens, batched=True, **kwargs)  # validates: raises before announcing
        self._next_id += 1
        self.events.append(["open", self._next_id, message])
        return MirroredStream(self._next_id, stream, self)

    def step_together(self, streams) -> list:
        from .batching import step_together

        try:
            with self.channel.busy():
                self.channel.message({"events": self.events, "step": [s.id for s in streams]})
                self.events = []
                results = step_together(self.engine, [s.stream for s in streams])
                _check_group_after_errors(results, self.channel)
                return results
        except Exception as e:  # a collective failed, or the ranks would now disagree: stop everything
            raise self.channel.fail(e) from e


def _check_group_after_errors(results, channel: Channel) -> None:
    """A generation that failed in a step may have failed because the group did (a collective
    inside its own ops raised): one more collective, on every rank alike (the ranks' failures are
    the same ones), raises GroupFailed then, and passes when the failure was the request's own."""
    if any(r.error is not None for r in results):
        channel.number()


def stop_followers(channel: Channel) -> None:
    """Rank 0, shutting down: tell the other ranks to finish (unless the group is broken)."""
    if not channel.failure:
        try:
            channel.message({"stop": True})
        except GroupFailed:
            pass


def follow(engine, channel: Channel) -> None:
    """Ranks other than 0, when serving: repeat rank 0's generations and steps until it stops.
    Raises GroupFailed when the group breaks."""
    from .batching import step_together

    streams: dict[int, Any] = {}
    try:
        while True:
            message = channel.message()
            if message.get("stop"):
                return
            for event in message["events"]:
                if event[0] == "open":
                    prompt, kwargs = request_arguments(event[2])
                    if kwargs.get("speculation") == "followed":
                        kwargs["speculation"] = FollowedPolicy(channel)
                    streams[event[1]] = engine.generate(prompt, batched=True, **kwargs)
                else:
                    streams.pop(event[1]).close()
            _check_group_after_errors(step_together(engine, [streams[i] for i in message["step"]]), channel)
    finally:
        for stream in streams.values():
            stream.close()
