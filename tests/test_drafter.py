"""The DFlash drafter: forward against a plain reference, taps, config layouts, validation."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from dflash_core.drafter import DFlashDrafter, load_drafter
from dflash_core.drafter_config import CheckpointError, DrafterConfig, default_target_layer_ids
from dflash_core.kernels import backend
from dflash_core.loading import load_checked_drafter, load_target

H, HEADS, KV, HD, V = 64, 4, 2, 16, 97


def _config(**overrides) -> DrafterConfig:
    raw = dict(
        architectures=["DFlashDraftModel"],
        hidden_size=H,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        intermediate_size=96,
        vocab_size=V,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=5,
        dflash_config=dict(block_size=8, target_layer_ids=[0, 2], mask_token_id=3),
    )
    raw.update(overrides)
    return DrafterConfig.from_dict(raw)


def _same(a: mx.array, b: mx.array) -> bool:
    """Bit for bit on the CPU, whose BLAS rounds a row alike whatever rows share the product. On a
    GPU, MLX's float32 GEMM is picked by the product's shape and its compiled blocks fuse
    elementwise ops into kernels of their own, so a position's numbers may differ in the last bits
    with the rows beside it or op by op (a draft's, never the target's: drafts only change how many
    are accepted): close there, and the tokens compared only on the CPU (a near tie may flip)."""
    if backend() == "cpu":
        return mx.array_equal(a, b)
    return a.dtype in (mx.int32, mx.uint32) or mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()


def _random_drafter(cfg: DrafterConfig, seed=0) -> DFlashDrafter:
    mx.random.seed(seed)
    model = DFlashDrafter(cfg)
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(k, mx.random.normal(v.shape) * (0.3 if v.ndim > 1 else 0.1) + (1.0 if v.ndim == 1 else 0.0))
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    return model


# ---------------------------------------------------------------- a plain reference, in numpy


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, theta=10000.0):
    # Non-interleaved (rotate-half) RoPE over the full head dim, x: [n, heads, hd].
    half = x.shape[-1] // 2
    inv = theta ** (-np.arange(half) / half)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _reference_logits(model: DFlashDrafter, taps, block_emb, embed_matrix, start):
    cfg = model.config
    p = {k: np.array(v, dtype=np.float64) for k, v in __import__("mlx.utils").utils.tree_flatten(model.parameters())}
    ctx = _rms(taps @ p["fc.weight"].T, p["hidden_norm.weight"])  # [S, H]
    S, B = ctx.shape[0], block_emb.shape[0]
    h = block_emb.copy()
    ctx_pos, blk_pos = np.arange(S, dtype=np.float64), np.arange(start, start + B, dtype=np.float64)
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        x = _rms(h, p[pre + "input_layernorm.weight"])
        q = (x @ p[pre + "self_attn.q_proj.weight"].T).reshape(B, HEADS, HD)
        q = _rope(_rms(q, p[pre + "self_attn.q_norm.weight"]), blk_pos)

        def kv(src, pos):
            n = src.shape[0]
            k = (src @ p[pre + "self_attn.k_proj.weight"].T).reshape(n, KV, HD)
            v = (src @ p[pre + "self_attn.v_proj.weight"].T).reshape(n, KV, HD)
            return _rope(_rms(k, p[pre + "self_attn.k_norm.weight"]), pos), v

        kc, vc = kv(ctx, ctx_pos)  # context skips input_layernorm
        kb, vb = kv(x, blk_pos)
        keys, values = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        key_pos = np.concatenate([ctx_pos, blk_pos])
        out = np.zeros((B, HEADS, HD))
        for qi in range(B):
            for head in range(HEADS):
                kvh = head // (HEADS // KV)
                scores = keys[:, kvh] @ q[qi, head] / math.sqrt(HD)
                visible = np.ones(len(key_pos), bool)
                if cfg.is_causal(i):
                    visible &= key_pos <= blk_pos[qi]
                if cfg.is_sliding(i):
                    visible &= np.abs(blk_pos[qi] - key_pos) < cfg.sliding_window
                scores = np.where(visible, scores, -np.inf)
                w = np.exp(scores - scores.max())
                out[qi, head] = (w / w.sum()) @ values[:, kvh]
        h = h + out.reshape(B, -1) @ p[pre + "self_attn.o_proj.weight"].T
        x = _rms(h, p[pre + "post_attention_layernorm.weight"])
        gate, up = x @ p[pre + "mlp.gate_proj.weight"].T, x @ p[pre + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ p[pre + "mlp.down_proj.weight"].T
    h = _rms(h, p["norm.weight"])
    logits = h[1:] @ embed_matrix.T * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = np.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


class _Lender:
    """The target's embedding and LM head, as an adapter lends them."""

    def __init__(self, embed):
        self.embed_matrix = embed

    def embed(self, tokens):
        return self.embed_matrix[tokens]

    def lm_head(self, h):
        return h @ self.embed_matrix.T


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"is_causal": True, "layer_types": None, "sliding_window": None},
        {"dflash_config": dict(block_size=8, target_layer_ids=[0, 2], mask_token_id=3, output_multiplier=0.5,
                               final_logit_softcapping=4.0, input_embedding_scale=1.5)},
    ],
    ids=["sliding-causal-mix", "all-causal", "scales-and-softcap"],
)
def test_drafter_forward_matches_reference(overrides):
    cfg = _config(**{k: v for k, v in overrides.items() if v is not None})
    if overrides.get("layer_types", 0) is None:
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    model = _random_drafter(cfg)
    mx.random.seed(1)
    embed = mx.random.normal((V, H))
    lender = _Lender(embed)
    cache = model.make_cache()
    # Context arrives in two pieces (prefill chunk, then an accepted verify prefix).
    taps = mx.random.normal((1, 11, 2 * H))
    model.add_context(taps[:, :7], cache)
    model.add_context(taps[:, 7:], cache)
    block = mx.array([[17] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    hidden = model.hidden(lender.embed(block), cache)
    got = np.array(model.logits(hidden[:, 1:], lender.lm_head)[0])
    emb = np.array(embed, dtype=np.float64)
    block_emb = emb[np.array(block[0])] * cfg.input_embedding_scale
    want = _reference_logits(model, np.array(taps[0], dtype=np.float64), block_emb, emb, start=11)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    proposals = model.propose(mx.array([17]), lender, cache)
    assert proposals.tolist() == np.argmax(want, axis=-1).tolist()


def test_default_taps_follow_zlab_rule():
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(40, 1) == [20]


def _write(dirpath, raw):
    (dirpath / "config.json").write_text(json.dumps(raw))


def test_both_layouts_load_the_same(tiny_pair_factory):
    _, new = tiny_pair_factory("qwen3", layout="new")
    _, old = tiny_pair_factory("qwen3", layout="old")
    a, b = load_drafter(new).config, load_drafter(old).config
    for key in ("block_size", "target_layer_ids", "mask_token_id", "rope_theta", "hidden_size", "num_hidden_layers"):
        assert getattr(a, key) == getattr(b, key), key


def test_a_training_report_s_held_out_acceptance_seeds_auto(tiny_pair_factory, caplog):
    """A drafter directory's train_report.json (`dflash train`'s) gives the loaded drafter its
    held-out acceptance by position, which an engine's `auto` starts from as 8 cycles of history; a
    z-lab directory (no report) gives none, and a report that says it wrongly a warning naming the
    file and key, and none."""
    from dflash_core.engine import Engine

    target_dir, drafter_dir = tiny_pair_factory("qwen3")
    target, tokenizer, _ = load_target(target_dir)
    assert load_drafter(drafter_dir).held_out_acceptance is None
    engine = Engine(target, tokenizer, load_drafter(drafter_dir))
    assert engine.speculation_state.held_out is None
    through = [0.5, 0.25, 0.125]
    (drafter_dir / "train_report.json").write_text(json.dumps({"steps": 3, "acceptance_by_position": through}))
    drafter = load_drafter(drafter_dir)
    assert drafter.held_out_acceptance.through == tuple(through)
    held_out = Engine(target, tokenizer, drafter).speculation_state.held_out
    assert held_out.verified[:4] == [8.0, 8.0, 8.0, 0.0] and held_out.accepted[:3] == [4.0, 2.0, 1.0]
    (drafter_dir / "train_report.json").write_text(json.dumps({"acceptance_by_position": []}))
    assert load_drafter(drafter_dir).held_out_acceptance is None and not caplog.text  # (a run with no cycle)
    (drafter_dir / "train_report.json").write_text(json.dumps({"acceptance_by_position": [0.2, 0.5]}))
    assert load_drafter(drafter_dir).held_out_acceptance is None
    assert "train_report.json: acceptance_by_position: expected" in caplog.text


def test_model_prefix_and_stray_embeddings_are_accepted(tiny_pair_factory, caplog):
    target, drafter = tiny_pair_factory("qwen3", weight_prefix="model.")
    weights = mx.load(str(drafter / "model.safetensors"))
    weights["embed_tokens.weight"] = mx.zeros((3, 3))
    mx.save_safetensors(str(drafter / "model.safetensors"), weights)
    model = load_drafter(drafter)
    assert model.fc.weight.shape[0] == model.config.hidden_size
    assert "ignoring embed_tokens.weight" in caplog.text


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), "architectures"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.update(layer_types=["sliding_attention"] * c["num_hidden_layers"], sliding_window=None), "sliding_window"),
    ],
    ids=["missing-mask", "dflash2", "missing-hidden", "sliding-without-window"],
)
def test_config_errors_name_file_and_key(tiny_pair_factory, edit, key):
    _, drafter = tiny_pair_factory("qwen3", layout="new")
    raw = json.loads((drafter / "config.json").read_text())
    edit(raw)
    _write(drafter, raw)
    with pytest.raises(CheckpointError) as err:
        load_drafter(drafter)
    assert str(drafter / "config.json") in str(err.value)
    assert key in str(err.value)


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 99]), "target_layer_ids"),
        (lambda c: c.update(vocab_size=c["vocab_size"] + 1), "vocab_size"),
    ],
    ids=["tap-out-of-range", "vocab-mismatch"],
)
def test_target_mismatch_errors(tiny_pair_factory, edit, key):
    target_dir, drafter = tiny_pair_factory("qwen3", layout="new")
    raw = json.loads((drafter / "config.json").read_text())
    edit(raw)
    _write(drafter, raw)
    target, _, _ = load_target(target_dir)
    with pytest.raises(CheckpointError) as err:
        load_checked_drafter(drafter, target)
    assert str(drafter / "config.json") in str(err.value) and key in str(err.value)


def test_hidden_size_mismatch(tiny_pair_factory):
    _, drafter = tiny_pair_factory("qwen3")  # hidden 64
    wide_target, _ = tiny_pair_factory("qwen3", target_kwargs={"shape": {"hidden_size": 96}})
    target, _, _ = load_target(wide_target)
    with pytest.raises(CheckpointError, match="hidden_size: drafter has 64, target has 96"):
        load_checked_drafter(drafter, target)


def test_unknown_weights_are_refused(tiny_pair_factory):
    _, drafter = tiny_pair_factory("qwen3")
    weights = mx.load(str(drafter / "model.safetensors"))
    weights["layers.0.self_attn.extra.weight"] = mx.zeros((2, 2))
    mx.save_safetensors(str(drafter / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="unexpected"):
        load_drafter(drafter)


def test_stacked_drafter_drafts_and_trains_the_same(monkeypatch, stack_lookups):
    """On CUDA each layer's k/v and gate/up are stacked into one matrix at load (kernels/matmul.py):
    run here on the CPU, the block's hidden states are unchanged and training still reaches every
    weight with the same gradients (the traced weights are new arrays, which bypass the stack)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dflash_core.kernels import matmul as small_m

    cfg = _config()
    plain, stacked = _random_drafter(cfg), _random_drafter(cfg)
    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    stacked.stack_shared_inputs()
    for layer in stacked.layers:
        assert layer.self_attn.kv_input.stacked and layer.gate_up_input.stacked
    mx.random.seed(5)
    taps = mx.random.normal((1, 6, 2 * H))
    block = mx.random.normal((1, cfg.block_size, H))

    def hidden(model):
        cache = model.make_cache()
        model.add_context(taps, cache)
        return model.hidden(block, cache)

    want = hidden(plain)
    assert stack_lookups == [False] * 3 * cfg.num_hidden_layers  # context k/v, block k/v, gate/up per layer
    stack_lookups.clear()
    assert mx.array_equal(hidden(stacked), want)
    assert stack_lookups == [True] * 3 * cfg.num_hidden_layers
    grads = [dict(tree_flatten(nn.value_and_grad(m, lambda m=m: (hidden(m) ** 2).sum())()[1])) for m in (plain, stacked)]
    for name in ("layers.0.self_attn.k_proj.weight", "layers.1.mlp.gate_proj.weight", "layers.2.mlp.up_proj.weight"):
        assert mx.abs(grads[0][name]).max().item() > 0
        assert mx.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5), name


@pytest.mark.parametrize(
    "overrides",
    [{}, {"is_causal": True, "layer_types": None, "sliding_window": None}],
    ids=["sliding-causal-mix", "all-causal"],
)
@pytest.mark.parametrize("n_context", [9, 509, 514], ids=["short", "ahead-taps-cross-a-buffer-step", "long"])
def test_drafting_ahead_drafts_what_drafting_after_the_read_does(overrides, n_context):
    """The engine's drafts ahead (`propose(start=...)`): all of a verify's taps in the context, the
    block's start on the device, the rejected positions' taps trimmed by the host afterwards. For
    every acceptance, the same hidden states and drafts as taking only the accepted taps first, and
    the context left as that leaves it; also where the sliding layers' first key is past 0, and where
    the ahead taps cross a step of the cache's buffer (256 slots) that the accepted ones do not."""
    cfg = _config(**{k: v for k, v in overrides.items() if v is not None})
    if overrides.get("layer_types", 0) is None:
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    model = _random_drafter(cfg)
    mx.random.seed(2)
    lender = _Lender(mx.random.normal((V, H)))
    context = mx.random.normal((1, n_context, 2 * H))  # what earlier cycles left in the context
    verify_taps = mx.random.normal((1, cfg.block_size, 2 * H))  # one cycle's, a tap per verified position
    block = mx.array([[17] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    for accepted in range(cfg.block_size):
        after_read, ahead = model.make_cache(), model.make_cache()
        for cache in (after_read, ahead):
            model.add_context(context, cache)
        model.add_context(verify_taps[:, : accepted + 1], after_read)
        want_hidden = model.hidden(lender.embed(block), after_read)
        want = model.propose(mx.array([17]), lender, after_read)

        model.add_context(verify_taps, ahead)
        start = mx.array(n_context + accepted + 1, mx.int32)
        got_hidden = model.hidden_rows(lender.embed(block), [ahead], [cfg.block_size], (start, n_context + 1))
        got = model.propose(mx.array([17]), lender, ahead, start=(start, n_context + 1))
        np.testing.assert_allclose(np.array(got_hidden), np.array(want_hidden), rtol=1e-5, atol=1e-5)
        assert _same(got, want)
        for cache in ahead:  # the host's trim, once it read the acceptance
            cache.offset = n_context + accepted + 1
        later = mx.random.normal((1, 3, 2 * H))
        for cache in (after_read, ahead):
            model.add_context(later, cache)
        assert all(_same(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])
                   for a, b in zip(after_read, ahead))
        assert _same(model.propose(mx.array([5]), lender, ahead), model.propose(mx.array([5]), lender, after_read))


def test_compiled_blocks_draft_what_the_layers_op_by_op_draft():
    """The engine's drafts run each layer's input norm, projections and (one block's) RoPE, and its
    o_proj and MLP, as two compiled blocks (`DrafterLayer.forward`), and a cycle's context
    projections as one: the same context, hidden states and drafts as op by op (`_same`: bit for bit
    on the CPU), for one block and for two rows' at once. Weights put into the same drafter
    afterwards (loaded, trained) are the ones its next drafts use: a block traced with the old ones
    as constants is traced again."""
    from dflash_core.kernels import KernelOptions

    cfg = _config()
    model = _random_drafter(cfg)
    op_by_op = model.with_kernels(KernelOptions(compiled_drafter=False))
    mx.random.seed(4)
    lender = _Lender(mx.random.normal((V, H)))
    taps = [mx.random.normal((1, n, 2 * H)) for n in (6, 11)]
    block = lender.embed(mx.array([[17] + [cfg.mask_token_id] * 7 + [23] + [cfg.mask_token_id] * 4]))

    def drafted(drafter):
        caches = [drafter.make_cache(), drafter.make_cache()]
        for cache, t in zip(caches, taps):
            drafter.add_context(t, cache)
        keys = [c.keys[..., : c.offset, :] for cache in caches for c in cache]
        return (*keys, drafter.hidden(block[:, :8], caches[0]), drafter.hidden_rows(block, caches, [8, 5]),
                drafter.propose(mx.array([17]), lender, caches[1]))

    before = drafted(model)
    assert all(_same(a, b) for a, b in zip(before, drafted(op_by_op)))

    model.update(_random_drafter(cfg, seed=3).parameters())
    after = drafted(model)
    assert not any(mx.array_equal(a, b) for a, b in zip(after[:-1], before[:-1]))
    assert all(_same(a, b) for a, b in zip(after, drafted(op_by_op)))


def test_drafts_ahead_on_a_gpu_by_default(monkeypatch):
    """`KernelOptions.draft_ahead`: unset, on where the device is not the host's own CPU (there
    drafting ahead only shares the same cores, and measured slower); set, as set."""
    from dflash_core import drafter as drafter_module
    from dflash_core.kernels import KernelOptions

    model = _random_drafter(_config())
    assert not model.drafts_ahead  # (this CPU)
    assert model.with_kernels(KernelOptions(draft_ahead=True)).drafts_ahead
    monkeypatch.setattr(drafter_module, "backend", lambda: "cuda")
    assert model.drafts_ahead
    assert not model.with_kernels(KernelOptions(draft_ahead=False)).drafts_ahead
