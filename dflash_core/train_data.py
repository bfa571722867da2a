"""`dflash train`'s data: prompts read from a file, and the target's own responses to them.

Responses are generated in shards of prompts, with up to `generation_batch` generations stepping
together: through the engine's own batching (batching.py, `generator="engine"`) or mlx-lm's
`BatchGenerator` (`generator="mlx-lm"`), whose one batched cache has far less host work a row at
hundreds of rows (docs/train.md has both speeds). Each finished shard is appended to
`sequences.jsonl` and recorded in `sequences.progress.json`, so a run cut short at any point
resumes at its first unfinished shard and ends with exactly the sequences an unbroken run makes.
Each prompt gives its greedy response and, with `samples_per_prompt` > 1, sampled ones, seeded
(per prompt and sample through the engine, per shard through mlx-lm), so they too are the same
after a restart; identical sequences are kept once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import mlx.core as mx

from .prompts import encode_rendered, hf_tokenizer, render_chat
from .sampling import SamplingParams

log = logging.getLogger(__name__)


def read_prompt_records(path: Path) -> list[dict]:
    """{"prompt", "category", "split"} from a .txt (one prompt per line), a .jsonl ({"prompt"},
    {"text"} or {"messages"}, with "category" and "split" where `dflash corpus` wrote them) or a
    directory of documents (each paragraph's opening is a prompt). "split" is None where the
    file does not say: training then holds out a random share."""
    path = Path(path)
    if path.is_dir():
        records = []
        for doc in sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file()):
            for paragraph in doc.read_text(errors="replace").split("\n\n"):
                paragraph = paragraph.strip()
                if len(paragraph) > 40:
                    records.append({"prompt": paragraph[: max(40, len(paragraph) // 3)], "category": "document",
                                    "split": None})
        return records
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            item = json.loads(line)
            prompt = item.get("messages") or item.get("prompt") or item.get("text")
            split = item.get("split")
            if split not in (None, "train", "held_out"):
                raise ValueError(f"{path}:{number}: split must be 'train' or 'held_out', not {split!r}")
            if prompt:
                records.append({"prompt": prompt, "category": item.get("category", "unlabelled"), "split": split})
        return records
    # A text file holds one prompt per line; "\\n" inside a line stands for a newline (code prompts).
    return [{"prompt": line.strip().replace("\\n", "\n"), "category": "unlabelled", "split": None}
            for line in path.read_text().splitlines() if line.strip()]


def encode_prompt(tokenizer, prompt, chat: bool, max_prompt_tokens: int) -> list[int]:
    """A prompt's tokens as the server renders a request (chat template) or as plain text; longer
    than `max_prompt_tokens`, it keeps its head (BOS, system turn) and its end."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if chat and getattr(hf_tokenizer(tokenizer), "chat_template", None):
        tokens = list(encode_rendered(tokenizer, render_chat(tokenizer, messages)))
    else:
        tokens = list(tokenizer.encode(prompt if isinstance(prompt, str) else messages[-1]["content"]))
    if len(tokens) > max_prompt_tokens:
        head = max_prompt_tokens // 4
        tokens = tokens[:head] + tokens[len(tokens) - (max_prompt_tokens - head):]
    return tokens


def _sampling(prompt_index: int, sample: int, temperature: float, seed: int) -> SamplingParams:
    if sample == 0:
        return SamplingParams()  # greedy: the target's own choice at every position
    return SamplingParams(temperature=temperature, seed=(seed * 1_000_003 + prompt_index) * 97 + sample)


def _seeded_sampler(temperature: float, seed: int):
    """One sampler for a batch of rows (mlx-lm's BatchGenerator then samples them in one call), its
    own key split at every step: the same seed gives the same tokens for the same batch."""
    state = [mx.random.key(seed)]

    def sample(logprobs: mx.array) -> mx.array:
        state[0], key = mx.random.split(state[0])
        return mx.random.categorical(logprobs * (1.0 / temperature), key=key)

    return sample


def mlx_lm_responses(model, prompts: list[list[int]], max_new_tokens: int, stop_ids, max_rows: int,
                     sampler=None, progress=None) -> list[list[int]]:
    """Each prompt's response through mlx-lm's BatchGenerator (up to `max_rows` at a time, a new
    one joining as one ends), the stop token that ended it included, as the engine's are; greedy
    unless `sampler` (one for all the rows, `_seeded_sampler`) is given."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=max_new_tokens, stop_tokens=[[t] for t in sorted(stop_ids)],
                               sampler=sampler, completion_batch_size=max_rows,
                               prefill_batch_size=min(max_rows, 64))
    try:
        uids = generator.insert(prompts)
        out: dict[int, list[int]] = {u: [] for u in uids}
        while responses := generator.next_generated():
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason is not None and progress is not None:
                    progress(1)
    finally:
        generator.close()
    return [out[u] for u in uids]


# What each part of the data's key comes from, for the error that names them.
KEY_FLAGS = {"target": "--target", "max_new_tokens": "--max-new-tokens", "max_prompt_tokens": "--max-prompt-tokens",
             "chat": "--no-chat", "samples": "--samples-per-prompt", "temperature": "--sample-temperature",
             "seed": "--seed", "generator": "--generator", "prompts": "--data"}


def _read_done(cache_file: Path, progress_file: Path, key: dict, target: str) -> tuple[int, list[dict], dict]:
    """The prompts already done, their sequences and the counters, from an earlier run with the
    same key; (0, [], {}) where there is none. Data made with another key is refused, not replaced:
    it may be a whole machine session's work."""
    if not (cache_file.exists() and progress_file.exists()):
        return 0, [], {}
    progress = json.loads(progress_file.read_text())
    made = dict(progress.get("key") or {})
    if made.get("target") == target:  # written before the key named a directory by its content
        made["target"] = key["target"]
    differ = [KEY_FLAGS.get(k, k) for k in key if made.get(k) != key[k]]
    if differ:
        raise ValueError(f"{cache_file} was made with other settings ({', '.join(differ)} differ from this run's): "
                         f"give the same ones to continue or train on it, or another --out (or delete "
                         f"{cache_file.parent}) to make new data")
    done = progress["prompts_done"]
    sequences = []
    for line in cache_file.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the interruption
            continue
        if item["prompt_index"] < done:  # lines past `done` belong to a shard that did not finish
            sequences.append(item)
    return done, sequences, progress.get("counters", {})


def target_key(target: str) -> str:
    """The target a data set was made with, as its key says: a local directory by its content (its
    config.json and its weight files' names and sizes), so that data brought to another machine,
    where the same model sits at another path, is found again; a repo id or a demo name by name."""
    path = Path(target).expanduser()
    if not (path / "config.json").is_file():
        return target
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return "sha256:" + digest.hexdigest()


def regenerate(engine, records: list[dict], opts, cache_file: Path, progress=None) -> list[dict]:
    """Prompt + the target's response, token ids, for every record and sample: {"tokens",
    "response_start", "prompt_index", "sample", "category", "split"}. `opts` is a TrainOptions
    (the response settings); `progress(n)` hears of each finished generation."""
    if opts.generator not in ("engine", "mlx-lm"):
        raise ValueError(f"generator: {opts.generator!r} is not 'engine' or 'mlx-lm'")
    samples, temperature, shard = max(1, opts.samples_per_prompt), opts.sample_temperature, max(1, opts.shard_prompts)
    prompts = [r["prompt"] for r in records]
    sampled = samples > 1  # the seed and temperature matter only to sampled responses
    key = {"target": target_key(str(opts.target)), "max_new_tokens": opts.max_new_tokens,
           "max_prompt_tokens": opts.max_prompt_tokens, "chat": opts.chat, "samples": samples,
           "temperature": temperature if sampled else None, "seed": opts.seed if sampled else None,
           "generator": opts.generator if sampled else None,
           "prompts": hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()}
    progress_file = cache_file.with_name("sequences.progress.json")
    done, sequences, counters = _read_done(cache_file, progress_file, key, str(opts.target))
    if done == len(records):
        return sequences
    if opts.generation_minutes == 0 and not sequences:  # (with data, the budget below starts no shard)
        raise ValueError(f"--generation-minutes 0 trains on the data made already, and {cache_file.parent} holds "
                         "none for these settings")
    if done:
        log.info("target responses: resuming after %d of %d prompts", done, len(records))
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text("".join(json.dumps(s) + "\n" for s in sequences))  # drops an unfinished shard
    seen = {tuple(s["tokens"]) for s in sequences}
    stops = engine.eos_token_ids
    generated = counters.get("generated_tokens", 0)
    seconds = counters.get("seconds", 0.0)
    budget = None if opts.generation_minutes is None else time.perf_counter() + 60 * opts.generation_minutes
    while done < len(records):
        if budget is not None and time.perf_counter() >= budget and sequences:
            log.info("target responses: the generation budget ran out after %d of %d prompts (a later run into "
                     "the same directory continues it)", done, len(records))
            break
        chunk = range(done, min(done + shard, len(records)))
        encoded = {i: encode_prompt(engine.tokenizer, prompts[i], opts.chat, opts.max_prompt_tokens) for i in chunk}
        jobs = [(i, k) for i in chunk for k in range(samples)]
        started = time.perf_counter()
        responses = _responses(engine, jobs, encoded, chunk.start, opts, progress)
        seconds += time.perf_counter() - started
        new = []
        for (i, k), response in zip(jobs, responses):
            generated += generated_tokens(response, stops)
            tokens = encoded[i] + response
            if len(response) >= 2 and tuple(tokens) not in seen:
                seen.add(tuple(tokens))
                new.append({"tokens": tokens, "response_start": len(encoded[i]), "prompt_index": i, "sample": k,
                            "category": records[i]["category"], "split": records[i]["split"]})
        with cache_file.open("a") as f:
            f.write("".join(json.dumps(s) + "\n" for s in new))
        sequences += new
        done = chunk.stop
        counters = {"generated_tokens": generated, "seconds": seconds}
        tmp = progress_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "prompts_done": done, "counters": counters}))
        tmp.replace(progress_file)  # the shard counts as done only once its lines are written
        log.info("target responses: %d of %d prompts, %d tokens, %.1f tok/s (%d at a time)", done, len(records),
                 generated, generated / seconds if seconds else 0.0, opts.generation_batch)
    return sequences


def _responses(engine, jobs: list[tuple[int, int]], encoded: dict, shard: int, opts, progress) -> list[list[int]]:
    """Each (prompt, sample) job's response, with the stop token that ended it, of the shard whose
    first prompt is `shard` (it seeds mlx-lm's sampled pass)."""
    if opts.generator == "mlx-lm":
        model, stops, rows = engine.target.model, engine.eos_token_ids, opts.generation_batch
        greedy = [j for j, (_, k) in enumerate(jobs) if k == 0]
        sampled = [j for j, (_, k) in enumerate(jobs) if k > 0]
        out: list = [None] * len(jobs)
        for members, sampler in ((greedy, None),
                                 (sampled, _seeded_sampler(opts.sample_temperature, opts.seed * 1_000_003 + shard))):
            if members:
                made = mlx_lm_responses(model, [encoded[jobs[j][0]] for j in members], opts.max_new_tokens, stops,
                                        rows, sampler, progress)
                for j, response in zip(members, made):
                    out[j] = response
        return out
    from .batching import generate_together

    requests = [{"prompt_tokens": encoded[i], "max_tokens": opts.max_new_tokens, "speculative": False,
                 "sampling": _sampling(i, k, opts.sample_temperature, opts.seed)} for i, k in jobs]
    return [engine_response(chunks) for chunks in generate_together(engine, requests, opts.generation_batch, progress)]


def engine_response(chunks) -> list[int]:
    """An engine generation's tokens with the stop token that ended it, as mlx-lm's BatchGenerator
    gives them: the end of turn is part of what drafts predict, so it is kept."""
    response = [t for c in chunks for t in c.token_ids]
    if chunks and chunks[-1].stop_token_id is not None:
        response.append(chunks[-1].stop_token_id)
    return response


def generated_tokens(response: list[int], stop_ids) -> int:
    """The tokens a response's generation made: all but the stop token that ended it."""
    return len(response) - bool(response and response[-1] in stop_ids)


def data_report(sequences: list[dict], progress_file: Path) -> dict:
    """What the training data holds: sequences and tokens by category and split, and the speed of
    the target's responses."""
    progress = json.loads(progress_file.read_text()) if progress_file.exists() else {}
    counters = progress.get("counters", {})
    by: dict = {}
    for s in sequences:
        entry = by.setdefault(s.get("category", "unlabelled"), {"sequences": 0, "response_tokens": 0})
        entry["sequences"] += 1
        entry["response_tokens"] += len(s["tokens"]) - s["response_start"]
    generated, seconds = counters.get("generated_tokens"), counters.get("seconds")
    return {"sequences": len(sequences), "tokens": sum(len(s["tokens"]) for s in sequences),
            "response_tokens": sum(len(s["tokens"]) - s["response_start"] for s in sequences),
            "held_out_sequences": sum(s.get("split") == "held_out" for s in sequences),
            "by_category": by, "prompts_done": progress.get("prompts_done"), "generated_tokens": generated,
            "generation_tokens_per_second": generated / seconds if generated and seconds else None}


def split_sequences(sequences: list[dict], rng, held_out: float) -> tuple[list[dict], list[dict]]:
    """(held_out, training): by the prompts' own split where the data says it, else a random
    `held_out` share of the prompts; either way every sample of a prompt is on one side."""
    if sequences and all(s.get("split") in ("train", "held_out") for s in sequences):
        held = [s for s in sequences if s["split"] == "held_out"]
        training = [s for s in sequences if s["split"] == "train"]
        if held and training:
            return held, training
        log.warning("the data's split leaves one side empty: holding out a random share instead")
    prompts = sorted({s["prompt_index"] for s in sequences})
    rng.shuffle(prompts)
    held_prompts = set(prompts[: max(1, int(len(prompts) * held_out))])
    return ([s for s in sequences if s["prompt_index"] in held_prompts],
            [s for s in sequences if s["prompt_index"] not in held_prompts])
