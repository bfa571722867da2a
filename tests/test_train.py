"""`dflash train`: the batched training forward equals inference, training lowers the loss, and
the result is a checkpoint the normal loader serves losslessly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_core import cli, train_data
from dflash_core import train as train_module
from dflash_core.drafter import load_drafter
from dflash_core.engine import Engine
from dflash_core.loading import load_target
from dflash_core.train import TrainOptions, batch_of, block_labels, block_logits, loss_lm_head, new_drafter, train

PROMPTS = [
    "Write a short story about a fox.", "Explain how rivers form.", "List three colors.",
    "What is speculative decoding?", "def add(a, b):", "The weather today is",
    "Describe a mountain at dawn.", "Count from one to ten.", "Why is the sky blue?",
    "Translate 'hello' to French.", "Give me a recipe for tea.", "Summarize the plot of a play.",
]


def _new_drafter_and_taps(pair):
    """A small new drafter for `pair`'s target, a sequence's tokens and the target's taps of them."""
    target, tokenizer, _ = load_target(pair[0])
    opts = TrainOptions(target="x", data=None, out=None, layers=2, head_dim=16, heads=4, kv_heads=2,
                        intermediate_size=96)
    drafter = new_drafter(target, tokenizer, opts)
    tokens = mx.array(tokenizer.encode("A sequence long enough to anchor several blocks in it."), dtype=mx.int32)
    taps = target.forward(tokens[None], target.make_cache(16), drafter.config.target_layer_ids).tapped_hidden
    return target, drafter, tokens, taps


def test_training_forward_matches_inference(qwen3_pair):
    target, drafter, tokens, taps = _new_drafter_and_taps(qwen3_pair)
    anchors = mx.array([3, 7, 11], dtype=mx.int32)
    batched = block_logits(drafter, target, taps, tokens, anchors)
    for k, anchor in enumerate(anchors.tolist()):
        context = drafter.make_cache()
        drafter.add_context(taps[:, :anchor], context)
        block = mx.array([[tokens[anchor].item()] + [drafter.config.mask_token_id] * 15])
        hidden = drafter.hidden(target.embed(block), context)
        single = drafter.logits(hidden[:, 1:], target.lm_head)[0]
        np.testing.assert_allclose(np.array(batched[k]), np.array(single), rtol=1e-4, atol=1e-4)


def test_a_trained_drafter_never_takes_the_exact_kernel(qwen3_pair, exact_attention_calls):
    """The exact attention kernel has no gradient: with the gate as on CUDA, a drafter made to
    train (new or loaded to train further) attends through MLX's ops, and its gradient flows,
    where the engine's drafter (`drafter_exact_attention`) would take the kernel."""
    from dflash_core.drafter import DFlashDrafter

    target, drafter, tokens, taps = _new_drafter_and_taps(qwen3_pair)
    assert train_module.initial_drafter(target, Path(qwen3_pair[1])).kernels.drafter_exact_attention is False
    exact_attention_calls.clear()  # (the target's own forward above went to the kernel)
    anchors = mx.array([3, 7], dtype=mx.int32)

    def loss(model):
        return block_logits(model, target, taps, tokens, anchors).astype(mx.float32).square().mean()

    value, grads = nn.value_and_grad(drafter, loss)(drafter)
    mx.eval(value, grads)
    assert exact_attention_calls == [] and drafter.kernels.drafter_exact_attention is False
    assert float(mx.abs(grads["layers"][0]["self_attn"]["q_proj"]["weight"]).sum()) > 0
    serving = DFlashDrafter(drafter.config, target.kernels)
    serving.update(drafter.parameters())
    block_logits(serving, target, taps, tokens, anchors)
    assert exact_attention_calls  # (the engine's options: the kernel's gate takes the blocks)


def test_a_step_of_sequences_trains_as_each_alone(qwen3_pair):
    """A step's sequences as one padded batch (`batch_of`) give every block the logits and labels
    it gets in its own sequence alone: it sees only its own sequence's context, its labels stop at
    its own sequence's end, and padding changes nothing."""
    target, tokenizer, _ = load_target(qwen3_pair[0])
    opts = TrainOptions(target="x", data=None, out=None, layers=2, head_dim=16, heads=4, kv_heads=2,
                        intermediate_size=96)
    drafter = new_drafter(target, tokenizer, opts)
    texts = ["A first sequence, long enough to anchor a few blocks.", "def second(x):\n    return x + 1",
             "Third: short but not too short."]
    pieces = []
    for text, anchors in zip(texts, ([2, 9], [1, 4, 10], [5])):
        ids = tokenizer.encode(text)
        taps = target.forward(mx.array([ids], dtype=mx.int32), target.make_cache(16),
                              drafter.config.target_layer_ids).tapped_hidden
        pieces.append((ids, taps, mx.array(anchors, dtype=mx.int32)))
    assert len({len(ids) for ids, _, _ in pieces}) > 1  # the batch pads some of them
    taps, tokens, anchors, sequence, labels = batch_of(pieces, 16)
    together = block_logits(drafter, target, taps, tokens, anchors, sequence=sequence)
    alone = mx.concatenate([block_logits(drafter, target, x, mx.array(t, dtype=mx.int32), a) for t, x, a in pieces])
    np.testing.assert_allclose(np.array(together), np.array(alone), rtol=1e-4, atol=1e-4)
    assert mx.array_equal(labels, mx.concatenate([block_labels(mx.array(t, dtype=mx.int32), a, 16) for t, _, a in pieces]))
    assert (np.array(labels) == -1).any()  # a block runs past its own sequence's end


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3", "gemma4"])
def test_taps_of_sequences_together_are_each_alone(request, family):
    """target_taps runs a step's sequences through the target as one padded batch: each one's
    hidden states are what it gets alone (sequences past the Gemma fixtures' sliding window of 8,
    Qwen3.5's recurrent layers running over the padding after a sequence). Within float32
    rounding, not to the bit: a batch of sequences runs mlx-lm's layers (MLX's attention), one
    sequence the adapter's rows (on the CPU, our softmax; kernels/attention.py)."""
    from dflash_core.train import target_taps

    target, _, _ = load_target(request.getfixturevalue(f"{family}_pair")[0])
    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, target.vocab_size, size=n).tolist() for n in (9, 31, 20)]
    together = target_taps(target, sequences, [0, 1])
    for seq, taps in zip(sequences, together):
        (alone,) = target_taps(target, [seq], [0, 1])
        assert taps.shape == alone.shape == (1, len(seq), alone.shape[-1])
        np.testing.assert_allclose(np.array(taps), np.array(alone), rtol=1e-4, atol=1e-4)


def test_tap_cache_holds_what_it_counts(qwen3_pair):
    """The tap cache keeps each sequence's taps in memory of its own: a slice of the batch's taps
    kept the whole batch alive, so the cache held many times its budget (a GPU ran out of memory
    in training). Kept taps are what the target gives, and nothing past the budget is kept."""
    from dflash_core.train_taps import TapCache, target_taps

    target, _, _ = load_target(qwen3_pair[0])
    rng = np.random.default_rng(5)
    # One long sequence beside short ones: a short one's slice of the padded batch is a small
    # part of it.
    sequences = [rng.integers(0, target.vocab_size, size=n).tolist() for n in (400, 6, 7, 8, 9, 10, 11, 12)]
    one = target_taps(target, [sequences[1]], [0, 1])[0].nbytes
    cache = TapCache(target, sequences, [0, 1], budget_bytes=one * 60)  # the short ones fit, the long one not
    mx.eval(cache(list(range(len(sequences)))))
    assert sorted(cache.kept) == [1, 2, 3, 4, 5, 6, 7]
    assert cache.kept_bytes == sum(t.nbytes for t in cache.kept.values()) <= cache.budget_bytes
    mx.clear_cache()
    held = mx.get_active_memory()
    cache.kept.clear()
    mx.clear_cache()
    # What the kept taps held, measured by MLX: their own bytes (the batch's taps of the long
    # sequence, 50x as many, held without the copy).
    assert held - mx.get_active_memory() <= 2 * cache.kept_bytes
    cache = TapCache(target, sequences, [0, 1], budget_bytes=one * 60)
    first = [np.array(t) for t in cache([3, 0, 5])]
    again = cache([5, 0, 3])  # 3 and 5 from the cache, 0 (not kept) from the target again
    assert sorted(cache.kept) == [3, 5]
    report = cache.report()
    assert (report["hits"], report["misses"], report["kept_sequences"]) == (2, 4, 2)
    assert report["target_seconds"] > 0
    for a, b, i in zip(first, again[::-1], (3, 0, 5)):
        np.testing.assert_array_equal(a, np.array(b))
        np.testing.assert_allclose(a, np.array(target_taps(target, [sequences[i]], [0, 1])[0]), rtol=1e-4, atol=1e-4)


def test_train_lowers_loss_and_writes_a_servable_drafter(qwen3_pair, tmp_path, capsys):
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS))
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "draft_vocab.json").write_text('{"token_ids": [1]}')  # an earlier run's, not this one's
    code = cli.main(["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out),
                     "--layers", "1", "--head-dim", "16", "--heads", "4", "--kv-heads", "2",
                     "--intermediate-size", "128", "--steps", "40", "--batch", "2", "--anchors", "4",
                     "--lr", "3e-3", "--warmup", "5", "--max-new-tokens", "32", "--eval-every", "20",
                     "--save-every", "20"])
    assert code == 0
    assert not (out / "draft_vocab.json").exists()  # (its drafts would have been over that one token)
    report = json.loads((out / "train_report.json").read_text())
    losses = [h["loss"] for h in report["history"]]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert report["tokens_per_cycle_estimate"] >= 1.0
    drafter = load_drafter(out)  # z-lab format, loads with the normal loader
    assert (out / "checkpoint" / "optimizer.safetensors").exists()
    target, tokenizer, _ = load_target(qwen3_pair[0])
    prompt = tokenizer.encode(PROMPTS[0])
    alone = [t for c in Engine(target, tokenizer).generate(prompt, max_tokens=48, stop_token_ids=set()) for t in c.token_ids]
    chunks = list(Engine(target, tokenizer, drafter).generate(prompt, max_tokens=48, stop_token_ids=set()))
    assert [t for c in chunks for t in c.token_ids] == alone
    assert chunks[-1].stats.speculative


def test_resume_continues_from_the_checkpoint(qwen3_pair, tmp_path, capsys):
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS))
    out = tmp_path / "drafter"
    common = ["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out), "--layers", "1",
              "--head-dim", "16", "--heads", "4", "--kv-heads", "2", "--intermediate-size", "64", "--batch", "1",
              "--anchors", "2", "--max-new-tokens", "16", "--save-every", "3", "--eval-every", "3"]
    assert cli.main(common + ["--steps", "3"]) == 0
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3
    assert cli.main(common + ["--steps", "6", "--resume"]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert [h["step"] for h in report["history"]] == [1, 2, 3, 4, 5, 6]  # the history survives the restart
    # The regenerated responses are reused only for the same target, prompts and settings; other
    # prompts are refused by name, the data left as it is (tests/test_corpus.py: the other settings).
    cached = (out / "data" / "sequences.jsonl").read_text()
    data.write_text("\n".join(PROMPTS[:6]))
    assert cli.main(common + ["--steps", "1"]) == 2
    assert "--data differ" in capsys.readouterr().err
    assert (out / "data" / "sequences.jsonl").read_text() == cached


def test_resume_keeps_the_target_dtype(qwen3_pair, tmp_path, capsys):
    """A run trained against the target cast to bfloat16 resumes only as one: its taps would
    change dtype mid-run otherwise."""
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS[:6]))
    out = tmp_path / "drafter"
    common = ["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out), "--layers", "1",
              "--head-dim", "16", "--heads", "4", "--kv-heads", "2", "--intermediate-size", "64", "--batch", "1",
              "--anchors", "2", "--max-new-tokens", "16", "--save-every", "2", "--eval-every", "2"]
    assert cli.main(common + ["--steps", "2", "--target-dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert cli.main(common + ["--steps", "4", "--resume"]) == 2
    assert "--target-dtype bfloat16" in capsys.readouterr().err
    assert cli.main(common + ["--steps", "4", "--resume", "--target-dtype", "bfloat16"]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert [h["step"] for h in report["history"]] == [1, 2, 3, 4] and report["taps"]["dtype"] == "bfloat16"


def test_init_from_trains_an_existing_drafter_further(qwen3_pair, tmp_path, capsys):
    """--init-from: the run starts from that drafter's weights and keeps its shape (config.json,
    taps, block size); the flags that would set a shape are refused, as is a drafter of another target."""
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS))
    first = tmp_path / "first"
    common = ["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--batch", "2", "--anchors", "4",
              "--max-new-tokens", "32", "--warmup", "2", "--eval-every", "1000", "--save-every", "1000"]
    assert cli.main(common + ["--out", str(first), "--layers", "2", "--head-dim", "16", "--heads", "4",
                              "--kv-heads", "2", "--intermediate-size", "64", "--block-size", "8",
                              "--steps", "30", "--lr", "3e-3"]) == 0
    trained = json.loads((first / "train_report.json").read_text())
    # With a learning rate of 0 a step changes nothing: the drafter written is the one started from.
    still = tmp_path / "still"
    assert cli.main(common + ["--out", str(still), "--init-from", str(first), "--steps", "1", "--lr", "0"]) == 0
    assert json.loads((still / "config.json").read_text()) == json.loads((first / "config.json").read_text())
    before, after = mx.load(str(first / "model.safetensors")), mx.load(str(still / "model.safetensors"))
    assert before.keys() == after.keys() and all(mx.array_equal(before[k], after[k]).item() for k in before)
    options = json.loads((still / "train_report.json").read_text())["options"]
    assert (options["layers"], options["block_size"]) == (2, 8) and options["init_from"] == str(first)
    # Trained further, it starts where the first run ended, not where a new drafter starts.
    further = tmp_path / "further"
    assert cli.main(common + ["--out", str(further), "--init-from", str(first), "--steps", "5", "--lr", "1e-3"]) == 0
    losses = [h["loss"] for h in json.loads((further / "train_report.json").read_text())["history"]]
    new_start = sum(h["loss"] for h in trained["history"][:3]) / 3
    assert sum(losses[:3]) / 3 < 0.8 * new_start
    capsys.readouterr()
    assert cli.main(common + ["--out", str(tmp_path / "x"), "--init-from", str(first), "--layers", "3",
                              "--block-size", "16"]) == 2
    assert "--layers, --block-size: the drafter's shape comes from --init-from" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(first, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    assert cli.main(common + ["--out", str(tmp_path / "y"), "--init-from", str(other), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert str(other / "config.json") in err and "vocab_size: drafter has" in err
    # Refused before the target generates anything (no data written), and by the library too.
    assert not (tmp_path / "y" / "data" / "sequences.jsonl").exists()
    with pytest.raises(ValueError, match="--heads: the drafter's shape comes from --init-from"):
        train(TrainOptions(target=str(qwen3_pair[0]), data=data, out=tmp_path / "z", init_from=str(first), heads=8))
    # A resumed run (the same command, --resume) continues from its checkpoint, in the drafter's shape.
    assert cli.main(common + ["--out", str(further), "--init-from", str(first), "--steps", "7", "--lr", "1e-3",
                              "--resume"]) == 0
    resumed = json.loads((further / "train_report.json").read_text())
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4, 5, 6, 7]
    shape = json.loads((first / "config.json").read_text())
    assert (resumed["options"]["heads"], resumed["options"]["intermediate_size"], resumed["options"]["taps"]) == (
        4, 64, shape["dflash_config"]["target_layer_ids"])


def test_a_time_budget_ends_the_run_decayed_saved_and_reported(qwen3_pair, tmp_path):
    """--minutes: the run stops when its budget runs out, long before --steps, with the learning
    rate decayed by time to its floor, a final estimate, checkpoint and drafter; a resumed run
    counts the seconds already trained."""
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS))
    out = tmp_path / "drafter"
    common = ["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out), "--layers", "1",
              "--head-dim", "16", "--heads", "4", "--kv-heads", "2", "--intermediate-size", "64", "--batch", "1",
              "--anchors", "2", "--max-new-tokens", "16", "--steps", "1000000", "--warmup", "2",
              "--lr", "1e-3", "--eval-every", "1000000", "--save-every", "1000000"]
    assert cli.main(common + ["--minutes", "0.05"]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["ended_by"] == "time" and 3 < report["steps"] < 1000000
    rates = [h["lr"] for h in report["history"]]
    assert rates[0] < rates[2] and max(rates) <= 1e-3
    after = rates[2:]
    assert all(a >= b for a, b in zip(after, after[1:]))  # decays by time, never back up
    assert after[-1] < 0.2e-3  # near the floor (5 % of --lr) when the budget ran out
    assert report["history"][-1]["tokens_per_cycle"] >= 1.0  # estimated at the end
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == report["steps"] and state["seconds"] >= 3.0
    load_drafter(out)
    # Resumed with the budget spent, it trains no further step and still reports.
    assert cli.main(common + ["--minutes", "0.05", "--resume"]) == 0
    again = json.loads((out / "train_report.json").read_text())
    assert again["steps"] == report["steps"] and again["tokens_per_cycle_estimate"] == report["tokens_per_cycle_estimate"]


def test_bad_options_are_one_clear_error(qwen3_pair, tmp_path, capsys):
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS))
    common = ["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(tmp_path / "d"),
              "--head-dim", "16", "--max-new-tokens", "4", "--steps", "1"]
    for bad, message in ((["--taps", "99"], "--taps"), (["--mask-token-id", "999999"], "--mask-token-id")):
        assert cli.main(common + bad) == 2
        assert message in capsys.readouterr().err
    for flag in ("--batch", "--anchors", "--layers"):
        with pytest.raises(SystemExit):  # argparse: "expected a positive integer"
            cli.main(common + [flag, "0"])
        assert "positive integer" in capsys.readouterr().err


def test_loss_heads_are_the_targets_head(qwen3_pair):
    """The loss's LM head: the target's own unless asked otherwise; restricted to some tokens it is
    the head's columns (a quantized untied head's too, not the embedding's); in bfloat16 it is the
    same product rounded, and a head already in that dtype is left to the target."""
    target, _, _ = load_target(qwen3_pair[0])
    ids = mx.array([5, 17, 300], dtype=mx.int32)
    hidden = mx.random.normal((2, 3, target.hidden_size))
    full = np.array(target.lm_head(hidden))
    assert loss_lm_head(target) is None
    np.testing.assert_allclose(np.array(loss_lm_head(target, ids)(hidden)), full[..., [5, 17, 300]], rtol=1e-5,
                               atol=1e-5)
    rounded = loss_lm_head(target, None, mx.bfloat16)(hidden)
    assert rounded.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(rounded.astype(mx.float32)), full, rtol=0.02, atol=0.02 * np.abs(full).max())
    assert np.abs(np.array(rounded.astype(mx.float32)) - full).max() > 0  # it is another product
    np.testing.assert_allclose(np.array(loss_lm_head(target, ids, mx.bfloat16)(hidden).astype(mx.float32)),
                               full[..., [5, 17, 300]], rtol=0.02, atol=0.02 * np.abs(full).max())
    target.text_model.set_dtype(mx.bfloat16)
    assert loss_lm_head(target, None, mx.bfloat16) is None
    head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
    head.weight = mx.random.normal(head.weight.shape) * 0.05
    target.text_model.lm_head = nn.QuantizedLinear.from_linear(head, group_size=32, bits=4)
    target.text_model.args.tie_word_embeddings = False
    assert loss_lm_head(target, None, mx.bfloat16) is None  # a quantized head stays the target's
    x = mx.random.normal((2, target.hidden_size))
    np.testing.assert_allclose(np.array(loss_lm_head(target, ids)(x)), np.array(target.text_model.lm_head(x)[..., ids]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_flags", [["--loss-vocab", "data"], ["--head-dtype", "bfloat16"],
                                        ["--target-dtype", "bfloat16"]])
def test_cheaper_loss_heads_still_learn(qwen3_pair, tmp_path, loss_flags):
    """--loss-vocab data, --head-dtype bfloat16 and --target-dtype bfloat16 (the target's taps and
    head in bfloat16, after the float32 target made the data): training on them still learns."""
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS))
    out = tmp_path / "drafter"
    assert cli.main(["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out),
                     "--layers", "1", "--head-dim", "16", "--heads", "4", "--kv-heads", "2",
                     "--intermediate-size", "128", "--steps", "60", "--batch", "2", "--anchors", "4",
                     "--lr", "3e-3", "--warmup", "5", "--max-new-tokens", "32"] + loss_flags) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["options"][loss_flags[0][2:].replace("-", "_")] == loss_flags[1]  # the run took the flag
    # The taps it trained on came from the target in the dtype asked for.
    assert report["taps"]["dtype"] == ("bfloat16" if loss_flags[0] == "--target-dtype" else "float32")
    assert report["taps"]["misses"] == report["taps"]["kept_sequences"] > 0
    # Saved in the dtype of the target as stored (float32 here), whatever it trained against.
    assert {w.dtype for w in mx.load(str(out / "model.safetensors")).values()} == {mx.float32}
    losses = [h["loss"] for h in report["history"]]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:5]) / 5
    load_drafter(out)


def test_the_estimate_walks_a_sequence_as_the_engine_does(qwen3_pair, tmp_path):
    """The held-out estimate is the engine's own figure: on the target's responses, always-on DFlash
    runs exactly the cycles the estimate walks. A drafter trained to draft some stretches well and
    others not makes the average over random positions differ from it (the estimate once overstated
    a real drafter's 1.33 tokens per cycle as 2.14)."""
    import random

    from dflash_core.train import acceptance_walk

    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS[:4]))
    out = tmp_path / "drafter"
    assert cli.main(["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out),
                     "--layers", "1", "--head-dim", "16", "--heads", "4", "--kv-heads", "2",
                     "--intermediate-size", "128", "--steps", "120", "--batch", "3", "--anchors", "8",
                     "--lr", "3e-3", "--warmup", "5", "--max-new-tokens", "48", "--held-out", "0.25",
                     "--eval-every", "1000", "--save-every", "1000", "--save-dtype", "float32",
                     "--draft-vocab", "1000"]) == 0
    sequences = [json.loads(line) for line in (out / "data" / "sequences.jsonl").read_text().splitlines()]
    target, tokenizer, _ = load_target(qwen3_pair[0])
    drafter = load_drafter(out)
    written = json.loads((out / "draft_vocab.json").read_text())
    assert drafter.draft_vocab.tolist() == written["token_ids"] and 0 < written["coverage"] <= 1
    assert set(written["token_ids"]) <= {t for s in sequences for t in s["tokens"][s["response_start"]:]}
    engine = Engine(target, tokenizer, drafter)

    def engine_walk():
        tokens = cycles = 0
        accepted_at, verified_at = np.zeros(15), np.zeros(15)
        for seq in sequences:
            prompt, response = seq["tokens"][: seq["response_start"]], seq["tokens"][seq["response_start"] :]
            chunks = list(engine.generate(prompt, max_tokens=len(response), speculation="on", stop_token_ids=set()))
            assert [t for c in chunks for t in c.token_ids] == response
            tokens, cycles = tokens + len(response) - 1, cycles + chunks[-1].stats.cycles  # the first: prefill's
            accepted_at += chunks[-1].stats.accepted_by_position
            verified_at += chunks[-1].stats.verified_by_position
        return tokens / cycles, accepted_at / verified_at

    # The report's estimate drafts over the draft vocabulary, as the engine then does; with half of
    # it the drafts past those tokens are never made, and both count that alike.
    for vocab in (drafter.draft_vocab, drafter.draft_vocab[::2]):
        drafter.draft_vocab = vocab
        engine_tokens, _ = engine_walk()
        walked_cut, _ = acceptance_walk(drafter, target, sequences, random.Random(0), draft_vocab=vocab)
        assert walked_cut == pytest.approx(engine_tokens, rel=1e-9)
    halved = walked_cut
    drafter.draft_vocab = None
    engine_tokens, engine_by_position = engine_walk()
    walked, by_position = acceptance_walk(drafter, target, sequences, random.Random(0))
    assert walked == pytest.approx(engine_tokens, rel=1e-9)
    assert halved < walked
    # Acceptance by position too, as the engine counts it.
    np.testing.assert_allclose(by_position, engine_by_position, rtol=1e-9)
    report = json.loads((out / "train_report.json").read_text())
    assert len(report["acceptance_by_position"]) == 15 and report["acceptance_by_position"][0] > 0
    assert walked > 1.5  # the drafter drafts: the walk measured something


def _sharded_run(qwen3_pair, tmp_path) -> tuple[Path, list[str]]:
    """A two-step run over 8 prompts in shards of 3: its --out and its `dflash` arguments."""
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS[:8]))
    out = tmp_path / "drafter"
    return out, ["train", "--target", str(qwen3_pair[0]), "--data", str(data), "--out", str(out), "--layers", "1",
                 "--head-dim", "16", "--heads", "4", "--kv-heads", "2", "--intermediate-size", "64", "--batch", "2",
                 "--anchors", "2", "--max-new-tokens", "12", "--steps", "2", "--shard-prompts", "3",
                 "--held-out", "0.25"]


def test_a_generation_budget_trains_on_the_shards_done_and_the_next_run_continues(qwen3_pair, tmp_path):
    out, common = _sharded_run(qwen3_pair, tmp_path)
    # A budget that is spent at once: the first shard still runs, the others wait for the next run.
    assert cli.main(common + ["--generation-minutes", "1e-9"]) == 0
    first = (out / "data" / "sequences.jsonl").read_text().splitlines()
    assert sorted({json.loads(line)["prompt_index"] for line in first}) == [0, 1, 2]
    report = json.loads((out / "train_report.json").read_text())
    assert report["sequences"] + report["held_out_sequences"] == len(first)
    assert cli.main(common) == 0
    every = (out / "data" / "sequences.jsonl").read_text().splitlines()
    assert every[: len(first)] == first  # continued, not started again
    assert sorted({json.loads(line)["prompt_index"] for line in every}) == list(range(8))


def test_generation_minutes_0_trains_on_the_data_made_so_far(qwen3_pair, tmp_path, capsys, monkeypatch):
    """A budget-cut data set, then `--generation-minutes 0`: training on those prompts alone, nothing
    generated (without it the run would first finish the data); with no data it is refused. And the
    generation's buffers are handed back before the drafter is built (on an 80 GB card they and the
    tap cache together ran out of memory)."""
    out, common = _sharded_run(qwen3_pair, tmp_path)
    assert cli.main(common + ["--generation-minutes", "0"]) == 2
    assert "--generation-minutes 0 trains on the data made already" in capsys.readouterr().err
    assert cli.main(common + ["--generate-only", "--generation-minutes", "0"]) == 2
    assert "--generate-only with --generation-minutes 0 makes nothing" in capsys.readouterr().err
    assert cli.main(common + ["--generate-only", "--generation-minutes", "1e-9"]) == 0
    made = (out / "data" / "sequences.jsonl").read_text()
    generated, responses = [], train_data._responses
    monkeypatch.setattr(train_data, "_responses", lambda engine, jobs, *rest: generated.extend(jobs) or
                        responses(engine, jobs, *rest))
    cached, build = [], train_module.new_drafter
    monkeypatch.setattr(train_module, "new_drafter", lambda *a: cached.append(mx.get_cache_memory()) or build(*a))
    assert cli.main(common + ["--generation-minutes", "0"]) == 0
    assert generated == [] and (out / "data" / "sequences.jsonl").read_text() == made
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 2 and report["data"]["prompts_done"] == 3
    assert cached == [0]
    with pytest.raises(SystemExit):
        cli.main(common + ["--generation-minutes", "-1"])


def test_generate_only_makes_the_data_and_a_later_run_trains_on_it(qwen3_pair, tmp_path, capsys, monkeypatch):
    """`--generate-only` (a machine session spent on data alone): the data and its report, no
    drafter; with a generation budget it grows over runs; a run without the flag into the same
    --out trains on that data as made, generating nothing."""
    out, common = _sharded_run(qwen3_pair, tmp_path)
    sequences = out / "data" / "sequences.jsonl"
    generated, responses = [], train_data._responses  # the prompts each run generates for

    def counted(engine, jobs, *rest):
        generated.extend(i for i, _ in jobs)
        return responses(engine, jobs, *rest)
    monkeypatch.setattr(train_data, "_responses", counted)
    assert cli.main(common + ["--generate-only", "--generation-minutes", "1e-9"]) == 0
    assert sorted(set(generated)) == [0, 1, 2]
    assert "3 prompts done" in capsys.readouterr().out
    report = json.loads((out / "data" / "data_report.json").read_text())
    assert report["prompts_done"] == 3 and report["sequences"] == len(sequences.read_text().splitlines())
    assert not (out / "model.safetensors").exists() and not (out / "train_report.json").exists()
    assert cli.main(common + ["--generate-only", "--resume"]) == 2
    assert "--resume: a --generate-only run trains nothing" in capsys.readouterr().err
    generated.clear()
    assert cli.main(common + ["--generate-only"]) == 0
    assert sorted(set(generated)) == [3, 4, 5, 6, 7]  # continued, not made again
    made = sequences.read_text()
    assert sorted({json.loads(line)["prompt_index"] for line in made.splitlines()}) == list(range(8))
    assert json.loads((out / "data" / "data_report.json").read_text())["prompts_done"] == 8
    assert not (out / "model.safetensors").exists()
    generated.clear()
    assert cli.main(common) == 0
    assert generated == [] and sequences.read_text() == made  # trained on the data as made
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 2 and report["data"]["sequences"] == len(made.splitlines())
    load_drafter(out)
