"""The fixed prompts of `dflash bench`, and the filler document that pads them to a context length.

A Python module rather than a data file so that it ships with the package without any
package-data configuration. Messages are in OpenAI chat format (tool-call arguments as JSON
strings), so the same prompts go to the engine (through the chat template) and to a server.
Changing a prompt changes every number measured with it: add new prompts rather than edit old ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class BenchPrompt:
    set: str
    name: str
    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = field(default=None)
    text: Optional[str] = None  # a plain completion prompt, encoded as it is (no chat template)


def _user(text: str, system: Optional[str] = None) -> list[dict[str, Any]]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": text}]


_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and a short forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "days": {"type": "integer", "description": "Forecast days, 1-7"}}, "required": ["city"]}}}
_READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file from the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
_RUN_TESTS = {"type": "function", "function": {
    "name": "run_tests", "description": "Run the test suite, or the tests matching a pattern.",
    "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}}}
_SEARCH = {"type": "function", "function": {
    "name": "search_flights", "description": "Search one-way flights.",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string"}, "destination": {"type": "string"},
        "date": {"type": "string", "description": "YYYY-MM-DD"}}, "required": ["origin", "destination", "date"]}}}

_AGENT_SYSTEM = "You are a careful assistant. Use the tools when they help, and answer briefly."
_CODE_SYSTEM = "You are a coding agent working in a Python repository. Use the tools to inspect and test code."

_BUGGY_FILE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    out = []
    for i in range(len(values) - window):
        out.append(sum(values[i:i + window]) / window)
    return out
'''

PROMPTS: list[BenchPrompt] = [
    # ------------------------------------------------------------------------------------ math
    BenchPrompt("math", "train-meeting", _user(
        "Two trains leave stations 300 km apart at 9:00, heading towards each other at 70 km/h and "
        "80 km/h. At what time do they meet, and how far from the first station? Show your steps.")),
    BenchPrompt("math", "sum-of-squares", _user(
        "Prove by induction that 1^2 + 2^2 + ... + n^2 = n(n+1)(2n+1)/6 for every positive integer n.")),
    BenchPrompt("math", "probability", _user(
        "A bag holds 5 red, 4 blue and 3 green marbles. Three are drawn without replacement. What is "
        "the probability that all three have different colours? Give the exact fraction.")),
    # ------------------------------------------------------------------------------------ code
    BenchPrompt("code", "lru-cache", _user(
        "Write a Python class LRUCache with get(key) and put(key, value) in O(1) time, using a dict "
        "and a doubly linked list. Include type hints and a short docstring.")),
    BenchPrompt("code", "parse-log", _user(
        "Write a Python function that reads an nginx access log and returns the ten most frequent "
        "client IP addresses with their request counts, sorted by count. Add a small unit test.")),
    BenchPrompt("code", "sql-window", _user(
        "Given a table orders(id, customer_id, created_at, amount), write a SQL query that returns, "
        "for each customer, their three largest orders and the running total of amount by date.")),
    # ------------------------------------------------------------------------------------ chat
    BenchPrompt("chat", "trip-plan", _user(
        "I have three days in Lisbon in October. Suggest a relaxed plan with food I should try.",
        system="You are a friendly travel assistant.")),
    BenchPrompt("chat", "explain-tcp", _user(
        "Explain to a curious teenager how TCP makes sure data arrives in order, with an analogy.")),
    BenchPrompt("chat", "email-reply", _user(
        "Write a polite reply to a colleague who asked me to review their design document by "
        "tomorrow; I can only do it on Friday. Keep it under 120 words.")),
    # ---------------------------------------------------------------------- agent (tool use)
    BenchPrompt("agent", "weather-call", _user(
        "Should I take an umbrella in Amsterdam tomorrow? Check the forecast.", system=_AGENT_SYSTEM),
        tools=[_WEATHER]),
    BenchPrompt("agent", "weather-answer", [
        {"role": "system", "content": _AGENT_SYSTEM},
        {"role": "user", "content": "Compare the weather in Oslo and Madrid for the next two days."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Madrid", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": '{"city": "Oslo", "forecast": [{"day": 1, "high_c": 4, "low_c": -2, "sky": "snow"}, '
                    '{"day": 2, "high_c": 2, "low_c": -5, "sky": "clear"}]}'},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather",
         "content": '{"city": "Madrid", "forecast": [{"day": 1, "high_c": 17, "low_c": 8, "sky": "sunny"}, '
                    '{"day": 2, "high_c": 15, "low_c": 7, "sky": "cloudy"}]}'},
    ], tools=[_WEATHER]),
    BenchPrompt("agent", "fix-bug", [
        {"role": "system", "content": _CODE_SYSTEM},
        {"role": "user", "content": "test_moving_average fails: the last window is missing. Fix utils/stats.py."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "utils/stats.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": _BUGGY_FILE},
    ], tools=[_READ_FILE, _RUN_TESTS]),
    BenchPrompt("agent", "flight-search", _user(
        "Find me a flight from Berlin to Rome on 2026-03-14, then tell me the cheapest option.",
        system=_AGENT_SYSTEM), tools=[_SEARCH, _WEATHER]),
]

PROMPT_SETS: tuple[str, ...] = ("math", "code", "chat", "agent")


def select_prompts(sets: Optional[list[str]] = None, per_set: Optional[int] = None) -> list[BenchPrompt]:
    """The bundled prompts of `sets` (default: all), the first `per_set` of each (default: all)."""
    sets = list(sets or PROMPT_SETS)
    unknown = [s for s in sets if s not in PROMPT_SETS]
    if unknown:
        raise ValueError(f"unknown prompt set(s) {unknown}; known: {', '.join(PROMPT_SETS)}")
    chosen = []
    for name in sets:
        chosen += [p for p in PROMPTS if p.set == name][:per_set]
    return chosen


def prompts_from_file(path, split: Optional[str] = "held_out", per_set: Optional[int] = None,
                      chat: bool = True) -> list[BenchPrompt]:
    """A prompt file `dflash train --data` reads (`dflash corpus` writes one) as bench prompts, one
    set per category: the prompts of `split` (None: all), the first `per_set` of each category.
    Text prompts go through the chat template as a user turn, or with `chat` False as they are
    (a base model, or a drafter trained with --no-chat)."""
    from .train_data import read_prompt_records

    chosen, counts = [], {}
    for i, record in enumerate(read_prompt_records(path)):
        if split is not None and record["split"] != split:
            continue
        category = record["category"]
        if per_set is not None and counts.get(category, 0) >= per_set:
            continue
        counts[category] = counts.get(category, 0) + 1
        prompt = record["prompt"]
        messages = prompt if isinstance(prompt, list) else _user(prompt)
        text = prompt if isinstance(prompt, str) and not chat else None
        chosen.append(BenchPrompt(category, f"{category}-{i}", messages, text=text))
    if not chosen:
        raise ValueError(f"{path}: no prompts{f' of the {split} split' if split else ''}")
    return chosen


# ---------------------------------------------------------------------------------- filler

# Sentences of a plausible (invented) operations manual. A fixed seed orders them, so the document
# is the same on every machine and every Python version (random.Random's seeding is stable).
_FILLER_SENTENCES = [
    "The pumping station draws water from the northern reservoir through two intake pipes.",
    "Each pipe has a coarse screen that operators clean every morning before the first shift.",
    "Pressure is logged every five minutes and compared with the limits in the control table.",
    "When the pressure drops below the lower limit, the standby pump starts automatically.",
    "Operators record every alarm in the shift book together with the action they took.",
    "The filters are backwashed when the head loss across them exceeds two metres.",
    "Chlorine dosing follows the flow rate, with a minimum residual measured at the outlet.",
    "Samples for the laboratory are taken at the inlet, after filtration and at the outlet.",
    "Valves on the distribution side are exercised once a month so that they do not seize.",
    "Spare parts for the pumps are kept in the store room next to the electrical panel.",
    "A maintenance request names the equipment, the fault observed and its urgency.",
    "During storms the inflow is watched closely, because turbidity can rise within an hour.",
    "The emergency generator is tested under load on the first Monday of every month.",
    "New staff shadow an experienced operator for two weeks before working a shift alone.",
    "Readings that look wrong are checked against a second instrument before anyone acts.",
    "The annual report summarises volumes treated, energy used and every incident of the year.",
]


def filler_text(paragraphs: int, seed: int = 2026) -> str:
    """`paragraphs` numbered sections of the manual, deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    for i in range(paragraphs):
        body = " ".join(rng.sample(_FILLER_SENTENCES, 6))
        out.append(f"Section {i + 1}. {body}")
    return "\n\n".join(out)


def filler_tokens(encode, count: int) -> list[int]:
    """The first `count` tokens of the filler document under `encode` (text -> ids)."""
    if count <= 0:
        return []
    paragraphs = max(1, count // 64)
    while True:
        ids = encode("Reference document:\n\n" + filler_text(paragraphs) + "\n\n")
        if len(ids) >= count:
            return ids[:count]
        paragraphs *= 2
