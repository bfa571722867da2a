"""The training corpus (dflash_core/corpus.py) and the resumable data generation of `dflash train`
(dflash_core/train_data.py), on the real standard library and a tiny real target."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from dflash_core import cli
from dflash_core.corpus import CATEGORIES, NOT_PROSE, build_corpus, normalised, split_of
from dflash_core.engine import Engine
from dflash_core.loading import load_target
from dflash_core.train import TrainOptions
from dflash_core.train_data import mlx_lm_responses, read_prompt_records, regenerate


def test_the_corpus_has_every_category_distinct_prompts_and_a_stable_split():
    corpus = build_corpus(per_category=40)
    assert [sum(c.category == cat for c in corpus) for cat in CATEGORIES] == [40] * 4
    assert [c.category for c in corpus[:8]] == list(CATEGORIES) * 2  # in turn: every head is balanced
    keys = [normalised(c.prompt) for c in corpus]
    assert len(set(keys)) == len(keys)
    assert build_corpus(per_category=40) == corpus  # the same on every build
    assert all(c.split == split_of(c.prompt) for c in corpus)
    code = [c for c in corpus if c.category == "code"]
    assert all(c.prompt.lstrip().startswith(("def ", "class ", "async def ", "@")) for c in code)
    for c in (c for c in corpus if c.category == "structured"):
        record = json.loads(c.prompt.splitlines()[-1] + 'a summary"}')  # an opened JSON record
        assert {"module", "name", "arguments", "summary"} <= record.keys()


def test_the_packages_installed_with_dflash_add_prompts_after_the_standard_library():
    packages = build_corpus(per_category=30, sources=["packages"])
    assert [sum(c.category == cat for c in packages) for cat in CATEGORIES] == [30] * 4
    assert all(c.source.split("/")[0] in ("numpy", "transformers") for c in packages)  # the first packages
    prose = [c.prompt for c in packages if c.category == "prose"]
    assert all(p[0].isupper() and not NOT_PROSE.search(p) for p in prose)  # sentences, not parameter lists
    asked = [c.prompt for c in packages if c.category == "chat"]
    assert all(p.startswith("What does numpy.") for p in asked)  # module names as imported
    # The standard library's prompts come first in each category: the corpus before the packages
    # joined is the head of every category now, so `--sources stdlib` rebuilds it.
    both = build_corpus(per_category=30)
    assert both == build_corpus(per_category=30, sources=["stdlib"])
    with pytest.raises(ValueError, match="sources"):
        build_corpus(sources=["internet"])


def test_the_split_is_decided_by_the_text_alone():
    assert split_of("Explain  how Rivers form.") == split_of("explain how rivers form.")
    texts = [f"prompt number {i} about something" for i in range(20000)]
    share = sum(split_of(t, 0.05) == "held_out" for t in texts) / len(texts)
    assert 0.04 < share < 0.06
    assert all(split_of(t, 0.05) == "held_out" for t in texts if split_of(t, 0.02) == "held_out")  # nested


def test_dflash_corpus_writes_what_dflash_train_reads(tmp_path, capsys):
    out = tmp_path / "corpus.jsonl"
    assert cli.main(["corpus", "--out", str(out), "--per-category", "12", "--held-out", "0.25"]) == 0
    assert "48 prompts" in capsys.readouterr().out
    records = read_prompt_records(out)
    assert len(records) == 48 and {r["category"] for r in records} == set(CATEGORIES)
    assert {r["split"] for r in records} == {"train", "held_out"}
    assert cli.main(["corpus", "--out", str(out), "--categories", "code,poetry"]) == 2
    assert "poetry" in capsys.readouterr().err
    assert cli.main(["corpus", "--out", str(out), "--sources", "stdlib,web"]) == 2
    assert "web" in capsys.readouterr().err
    assert cli.main(["corpus", "--out", str(out), "--per-category", "3", "--sources", "packages"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 12 and {r["source"].split("/")[0] for r in written} <= {"numpy", "transformers"}


PROMPTS = ["def add(a, b):", "The weather today is", "Count from one to ten.", "Why is the sky blue?",
           "List three colors.", "Explain how rivers form.", "A fox and a crow", "import os\n",
           "Dear team,", "Once upon a time", "SELECT * FROM", "The capital of France"]


def _records():
    return [{"prompt": p, "category": "code" if i % 2 else "prose", "split": "held_out" if i in (3, 7) else "train"}
            for i, p in enumerate(PROMPTS)]


def _opts(target_dir, out, generator="engine"):
    return TrainOptions(target=str(target_dir), data=None, out=out, max_new_tokens=12, generation_batch=4,
                        chat=False, samples_per_prompt=2, sample_temperature=1.0, shard_prompts=4, generator=generator)


class Cut(Exception):
    pass


@pytest.mark.parametrize("generator", ["engine", "mlx-lm"])
def test_a_cut_generation_resumes_to_what_an_unbroken_run_makes(qwen3_pair, tmp_path, generator):
    target, tokenizer, _ = load_target(qwen3_pair[0])
    engine = Engine(target, tokenizer)
    unbroken = regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path / "a", generator), tmp_path / "a" / "sequences.jsonl")
    assert {s["sample"] for s in unbroken} == {0, 1}
    greedy = {s["prompt_index"]: s["tokens"] for s in unbroken if s["sample"] == 0}
    assert any(s["tokens"] != greedy.get(s["prompt_index"]) for s in unbroken if s["sample"] == 1)  # sampled
    assert {s["split"] for s in unbroken if s["prompt_index"] in (3, 7)} == {"held_out"}

    cache = tmp_path / "b" / "sequences.jsonl"
    ends = []

    def cut_in_the_second_shard(n):
        ends.append(n)
        if len(ends) == 10:  # a shard is 4 prompts x 2 samples: this is inside the second
            raise Cut
    with pytest.raises(Cut):
        regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path / "b", generator), cache, cut_in_the_second_shard)
    assert json.loads(cache.with_name("sequences.progress.json").read_text())["prompts_done"] == 4
    ends.clear()
    resumed = regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path / "b", generator), cache, ends.append)
    assert len(ends) == 16  # the first shard was not generated again
    assert resumed == unbroken
    assert [json.loads(line) for line in cache.read_text().splitlines()] == unbroken
    ends.clear()
    assert regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path / "b", generator), cache, ends.append) == unbroken
    assert ends == []  # all done: nothing generated


def test_mlx_lm_generator_gives_the_engines_greedy_responses(qwen3_pair, tmp_path):
    """The greedy responses (what the drafter learns to predict) are the target's own through either
    generator, stop token included; sampled ones differ between them (each its own random stream)
    but each is reproducible."""
    target, tokenizer, _ = load_target(qwen3_pair[0])
    engine = Engine(target, tokenizer)
    made = {g: regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path / g, g), tmp_path / g / "sequences.jsonl")
            for g in ("engine", "mlx-lm")}
    greedy = {g: {s["prompt_index"]: s["tokens"] for s in made[g] if s["sample"] == 0} for g in made}
    assert greedy["engine"] == greedy["mlx-lm"] and len(greedy["engine"]) == len(PROMPTS)
    again = regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path / "again", "mlx-lm"),
                       tmp_path / "again" / "sequences.jsonl")
    assert again == made["mlx-lm"]


def test_mlx_lm_responses_end_with_the_stop_token_as_the_engines_do(qwen3_pair):
    target, tokenizer, _ = load_target(qwen3_pair[0])
    engine = Engine(target, tokenizer)
    prompt = tokenizer.encode("Once upon a time")
    alone = [t for c in engine.generate(prompt_tokens=prompt, max_tokens=12, speculative=False) for t in c.token_ids]
    stop = alone[4]
    cut = alone[: alone.index(stop) + 1]
    [response] = mlx_lm_responses(target.model, [prompt], 12, {stop}, 4)
    assert response == cut  # the stop token ends it and is kept


def test_training_holds_out_the_prompts_the_data_marks(qwen3_pair, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    out = tmp_path / "drafter"
    assert cli.main(["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out), "--layers", "1",
                     "--head-dim", "16", "--heads", "4", "--kv-heads", "2", "--intermediate-size", "64", "--batch", "2",
                     "--anchors", "2", "--max-new-tokens", "12", "--steps", "2", "--eval-every", "2", "--no-chat",
                     "--samples-per-prompt", "2", "--shard-prompts", "5"]) == 0
    report = json.loads((out / "train_report.json").read_text())
    sequences = [json.loads(line) for line in (out / "data" / "sequences.jsonl").read_text().splitlines()]
    held = [s for s in sequences if s["prompt_index"] in (3, 7)]
    assert report["held_out_sequences"] == len(held) > 0
    assert report["sequences"] == len(sequences) - len(held)
    assert report["data"]["by_category"].keys() == {"code", "prose"}
    assert report["data"]["generation_tokens_per_second"] > 0 and report["trained_tokens_per_second"] > 0
    assert "tok/s" in capsys.readouterr().out


def test_dflash_bench_measures_a_corpus_by_category(qwen3_pair, tmp_path, capsys):
    from dflash_core import bench

    data = tmp_path / "prompts.jsonl"
    records = [*_records(), {"messages": [{"role": "user", "content": "Say hi."}], "category": "chat",
                             "split": "held_out"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "bench.json"
    target, drafter = qwen3_pair
    common = ["bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(data), "--contexts", "8",
              "--max-tokens", "12", "--repeats", "1", "--cooldown", "0", "--no-plots", "--no-progress", "--out", str(out)]
    assert cli.main(common + ["--no-chat"]) == 0
    report = bench.load_report(out)
    # Only the held-out prompts (3, 7: "code"; the chat one), one set per category, all matched.
    assert {r.prompt for r in report.results} == {"code-3", "code-7", "chat-12"}
    assert [s.set for s in report.summary] == ["code", "chat", "all"]
    assert report.all_matched is True and report.settings.prompts_file == str(data) and not report.settings.chat
    target_engine, tokenizer, _ = load_target(target)
    by_name = {r.prompt: r for r in report.results}
    assert by_name["code-3"].prompt_tokens == len(tokenizer.encode(PROMPTS[3]))  # as it is, no template
    assert cli.main(common + ["--prompts-split", "train", "--prompts-per-set", "1"]) == 0
    assert {r.set for r in bench.load_report(out).results} == {"code", "prose"}
    capsys.readouterr()
    assert cli.main(common + ["--server", "http://127.0.0.1:9"]) == 2
    assert "--prompts" in capsys.readouterr().err


def test_data_brought_to_another_path_of_the_same_target_is_found_again(qwen3_pair, tmp_path):
    """The data's key names the target by its content, not its path: the same model copied
    elsewhere (another machine's cache) continues the data; a target with another config, or other
    response settings, is refused by name, the data left as it is."""
    target, tokenizer, _ = load_target(qwen3_pair[0])
    engine = Engine(target, tokenizer)
    cache = tmp_path / "data" / "sequences.jsonl"
    made_data = regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path, "engine"), cache)
    moved = tmp_path / "elsewhere"
    shutil.copytree(qwen3_pair[0], moved)
    ends = []
    assert regenerate(engine, _records(), _opts(moved, tmp_path, "engine"), cache, ends.append) == made_data
    assert ends == []  # nothing generated again
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "rope_theta": config.get("rope_theta", 10000) * 2}))
    before = cache.read_text()
    with pytest.raises(ValueError, match="--target differ"):
        regenerate(engine, _records(), _opts(moved, tmp_path, "engine"), cache, ends.append)
    longer = replace(_opts(qwen3_pair[0], tmp_path, "engine"), max_new_tokens=20)
    with pytest.raises(ValueError, match="--max-new-tokens differ"):
        regenerate(engine, _records(), longer, cache, ends.append)
    assert ends == [] and cache.read_text() == before
    # Data whose key named the target by its path (before it named it by content) is still found.
    progress = cache.with_name("sequences.progress.json")
    made = json.loads(progress.read_text())
    progress.write_text(json.dumps({**made, "key": {**made["key"], "target": str(qwen3_pair[0])}}))
    assert regenerate(engine, _records(), _opts(qwen3_pair[0], tmp_path, "engine"), cache, ends.append) == made_data
