"""Adapters compute exactly what mlx-lm's own models compute, and taps are layer outputs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import ENGINE_FAMILIES as FAMILIES
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from dflash_core.loading import load_target

TOL = dict(rtol=1e-4, atol=1e-4)


def _tokens(adapter, n, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, adapter.vocab_size, size=(1, n)), dtype=mx.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_mlx_lm(request, family):
    target_dir, _ = request.getfixturevalue(f"{family}_pair")
    adapter, _, _ = load_target(target_dir)
    prompt, step = _tokens(adapter, 21), _tokens(adapter, 1, seed=1)
    ours, theirs = adapter.make_cache(max_rollback=16), make_prompt_cache(adapter.model)
    np.testing.assert_allclose(
        np.array(adapter.forward(prompt, ours).logits), np.array(adapter.model(prompt, cache=theirs)), **TOL
    )
    # Decoding continues identically from both caches.
    for _ in range(3):
        a = adapter.forward(step, ours).logits
        b = adapter.model(step, cache=theirs)
        np.testing.assert_allclose(np.array(a), np.array(b), **TOL)


def _manual_layer_outputs(adapter, tokens):
    """Each decoder layer's output from a plain loop over mlx-lm's own layer modules (for Qwen3.5
    this runs mlx-lm's GatedDeltaNet, not the adapter's mixer)."""
    h = adapter.inner.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    outputs = []
    for layer in adapter.layers:
        is_linear = getattr(layer, "is_linear", False)
        h = layer(h, None if is_linear else mask, None)
        outputs.append(h)
    return outputs


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_taps_are_layer_outputs(request, family):
    target_dir, _ = request.getfixturevalue(f"{family}_pair")
    adapter, _, _ = load_target(target_dir)
    tokens = _tokens(adapter, 12)
    tap_ids = list(range(adapter.num_layers))
    out = adapter.forward(tokens, adapter.make_cache(16), tap_ids)
    manual = _manual_layer_outputs(adapter, tokens)
    H = adapter.hidden_size
    for i in tap_ids:
        np.testing.assert_allclose(np.array(out.tapped_hidden[..., i * H : (i + 1) * H]), np.array(manual[i]), **TOL)
    # Taps come back concatenated in the order asked for, not in layer order.
    picked = adapter.forward(tokens, adapter.make_cache(16), [2, 0]).tapped_hidden
    np.testing.assert_allclose(np.array(picked[..., :H]), np.array(manual[2]), **TOL)
    np.testing.assert_allclose(np.array(picked[..., H:]), np.array(manual[0]), **TOL)


def test_gemma4_last_tap_is_the_prenorm_hidden_state(gemma4_pair):
    target_dir, _ = gemma4_pair
    adapter, _, _ = load_target(target_dir)
    tokens = _tokens(adapter, 21)
    last = adapter.num_layers - 1
    out = adapter.forward(tokens, adapter.make_cache(16), [last])
    np.testing.assert_allclose(np.array(adapter.logits(out.tapped_hidden)), np.array(out.logits), **TOL)
    # Gemma's embedding scale belongs to the target, not to what the drafter is given.
    raw = adapter.embed(tokens)
    np.testing.assert_allclose(np.array(raw), np.array(adapter.inner.embed_tokens(tokens)), **TOL)


def test_wrapped_checkpoints_unwrap_to_the_language_model(qwen3_5_pair, gemma4_pair):
    for target_dir in (qwen3_5_pair[0], gemma4_pair[0]):
        adapter, _, config = load_target(target_dir)
        assert "text_config" in config
        assert adapter.text_model is adapter.model.language_model


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_other_kernel_options_trace_their_own_blocks(request, family):
    """`with_kernels` (a benchmark's arm) runs the same model and weights with its own compiled
    blocks, keyed by the options: nothing to clear, and switching back traces nothing again. On
    this CPU every option's path is MLX's own, so the logits are the same."""
    from dflash_core.kernels import KernelOptions

    target_dir, _ = request.getfixturevalue(f"{family}_pair")
    adapter, _, _ = load_target(target_dir)
    tokens = _tokens(adapter, 12)  # a verify-sized forward: compiled blocks

    def logits(target):
        return target.forward(tokens, target.make_cache(16), record=True).logits

    want = logits(adapter)
    traced = set(adapter._compiled_fns)
    other = adapter.with_kernels(KernelOptions(block_attention=False, step_states=False, cuda_matmul=False))
    assert other.model is adapter.model and other.shared_inputs is adapter.shared_inputs
    assert adapter.kernels == KernelOptions()  # the original keeps its own
    assert mx.array_equal(logits(other), want)
    added = set(adapter._compiled_fns) - traced
    assert added and {kernels for kernels, _ in added} == {other.kernels}
    assert mx.array_equal(logits(adapter), want)
    assert set(adapter._compiled_fns) == traced | added


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gemma3_norm_scales_are_the_modules_own_norms(gemma3_pair, dtype):
    """Gemma 3's decode and verify norms take `1 + weight` made once at load (`NormScales`) rather
    than at every call: the same bits as mlx-lm's RMSNorm, every norm of the model covered, and a
    norm whose weight is replaced afterwards is computed from its new weight."""
    from mlx_lm.models.gemma3_text import RMSNorm

    target_dir, _ = gemma3_pair
    adapter, _, _ = load_target(target_dir)
    norms = [m for _, m in adapter.text_model.named_modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * len(adapter.layers) + 2 * len(adapter.layers) + 1  # per layer 4 + q, k; final
    assert {id(m) for m in norms} == set(adapter.norms.scales)
    rng = np.random.default_rng(0)
    for norm in norms:
        norm.weight = mx.array(rng.normal(size=norm.weight.shape), dtype=dtype)
    adapter.norms.__init__(adapter.text_model)
    for norm in norms:
        x = mx.array(rng.normal(size=(2, 5, norm.weight.shape[0])) * 3, dtype=dtype)
        assert mx.array_equal(adapter.norms(norm, x), norm(x)), norm
    replaced = norms[0]
    replaced.weight = replaced.weight + 1
    x = mx.array(rng.normal(size=(1, 3, replaced.weight.shape[0])), dtype=dtype)
    assert mx.array_equal(adapter.norms(replaced, x), replaced(x))
    assert not mx.array_equal(adapter.norms(replaced, x), mx.fast.rms_norm(x, adapter.norms.scales[id(replaced)][2],
                                                                           replaced.eps))


def _fused_kernels(out: mx.array) -> list[str]:
    """The element-wise kernels mx.compile made for `out` (its graph's Compiled nodes)."""
    import io
    import re

    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return [label for label in re.findall(r'label ?= ?"([^"]*)"', dot.getvalue()) if label.startswith("Compiled")]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gemma3_gelu_is_mlx_lms_and_one_kernel_off_the_cpu(dtype):
    """Gemma 3's MLP activation is mlx-lm's `gelu_approx(gate) * up`: off the CPU (`gelu_tanh_gate`)
    as its own ops, one fused kernel in a compiled block, with the bits it has op by op (a
    prefill's), where the CPU's form with the rational tanh is 5 or more (mx.compile fuses chains
    at most 11 ops deep); in float32 both are within 1e-5 of mlx-lm's."""
    import mlx.nn as nn

    from dflash_core.adapters.gemma3 import gelu_approx_gate, gelu_rational_gate, gelu_tanh_gate
    from dflash_core.kernels import backend

    rng = np.random.default_rng(1)
    gate = mx.array(rng.normal(size=(1, 16, 640)) * 3, dtype=dtype)
    up = mx.array(rng.normal(size=(1, 16, 640)), dtype=dtype)
    mx.eval(gate, up)
    tanh_form, rational_form = mx.compile(gelu_tanh_gate)(gate, up), gelu_rational_gate(gate, up)
    assert len(_fused_kernels(tanh_form)) == 1  # (counted before anything evaluates the graphs)
    assert len(_fused_kernels(rational_form)) >= 5
    assert mx.array_equal(gelu_approx_gate(gate, up), rational_form if backend() == "cpu" else tanh_form)
    assert mx.array_equal(tanh_form, gelu_tanh_gate(gate, up))
    if dtype == mx.float32:
        reference = np.array(nn.gelu_approx(gate) * up)
        np.testing.assert_allclose(np.array(tanh_form), reference, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(rational_form), reference, rtol=1e-5, atol=1e-5)
