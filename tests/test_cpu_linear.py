"""The CPU primitive for a target's projections (dflash_core/kernels/cpu_linear.py, cpu_linear.cpp):
its products against MLX's on the same weights, row-invariant to the bit, inside compiled functions
and under `mx.grad`; int8 blocks (with or without a bias per block) found exactly where float32
weights are GGUF-style blocks; and speculative output with it, float16, int8 and affine int8
copies, exactly the target-alone output for every family (every acceptance length, greedy and
seeded sampling, batched rows)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from families import ENGINE_FAMILIES, sample_prompt
from forced import (
    assert_batched_rows_are_as_alone,
    assert_every_acceptance_length_is_lossless,
    assert_verify_is_single_steps,
    tokens,
)

from dflash_core.engine import Engine
from dflash_core.kernels import KernelOptions, cpu_linear, matmul
from dflash_core.kernels.cpu_head import affine_blocks, int8_blocks
from dflash_core.loading import load_engine
from dflash_core.sampling import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def primitive(cpu_kernels):
    return cpu_kernels


def _random(shape, seed, scale=1.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def _int8_exact(weight: mx.array, divisor: int = 127) -> mx.array:
    """`weight` as a GGUF quantizer leaves it in blocks of 32: Q8_0 (divisor 127: scale = largest
    magnitude / 127), or Q5_0 / Q4_0 (16 / 8: scale = the signed largest value / -divisor, numbers
    clipped to [-divisor, divisor - 1])."""
    N, K = weight.shape
    blocks = np.array(weight).reshape(N, K // 32, 32)
    at = np.abs(blocks).argmax(axis=2)[..., None]
    signed_max = np.take_along_axis(blocks, at, axis=2)
    if divisor == 127:
        scale, low, high = np.abs(signed_max) / np.float32(127), -127, 127
    else:
        scale, low, high = signed_max / np.float32(-divisor), -divisor, divisor - 1
    scale = scale.astype(np.float32)
    return mx.array((np.clip(np.rint(blocks / scale), low, high) * scale).reshape(N, K).astype(np.float32))


def _affine_exact(weight: mx.array) -> mx.array:
    """`weight` as GGUF's Q4_K leaves it in blocks of 32: a float32 scale and minimum per block,
    numbers 0..15, each weight scale * q - minimum rounded to float32 (as its dequantizer does)."""
    N, K = weight.shape
    blocks = np.array(weight).reshape(N, K // 32, 32).astype(np.float32)
    low, high = blocks.min(axis=2, keepdims=True), blocks.max(axis=2, keepdims=True)
    scale = np.float16((high - low) / 15).astype(np.float32)  # (an fp16 super-scale times a 6-bit one, in Q4_K)
    minimum = np.float16(-low).astype(np.float32)
    numbers = np.clip(np.rint((blocks + minimum) / scale), 0, 15).astype(np.float32)
    return mx.array((scale * numbers - minimum).reshape(N, K))


@pytest.mark.parametrize("K", [64, 72, 640])  # a multiple of the kernel's 16, one with a tail, the demo's
def test_the_float16_product_is_the_rounded_weights_product(K):
    weight = _random((700, K), 0, 0.05)
    x = _random((2, 8, K), 1)
    copy = cpu_linear.narrow_copy(weight)
    assert len(copy) == 1 and copy[0].dtype == mx.float16  # random weights are not int8 blocks
    got = cpu_linear.narrow_linear(x, copy)
    assert got.shape == (2, 8, 700) and got.dtype == mx.float32
    want = x @ weight.astype(mx.float16).astype(mx.float32).T
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.array(got), np.array(x @ weight.T), rtol=1e-6, atol=1e-7)  # really float16


@pytest.mark.parametrize("divisor", [127, 16, 8])  # as GGUF's Q8_0, Q5_0 and Q4_0 quantize
def test_int8_blocks_are_found_exactly_and_multiplied(divisor):
    weight = _int8_exact(_random((300, 128), 2, 0.05), divisor)
    q, scales = int8_blocks(weight)
    assert q.dtype == np.int8 and scales.shape == (300, 4)
    np.testing.assert_array_equal((q.reshape(300, 4, 32) * scales[..., None]).reshape(300, 128), np.array(weight))
    copy = cpu_linear.narrow_copy(weight)
    assert [a.dtype for a in copy] == [mx.int8, mx.float32]
    x = _random((5, 128), 3)
    np.testing.assert_allclose(np.array(cpu_linear.narrow_linear(x, copy)), np.array(x @ weight.T), rtol=1e-5, atol=1e-5)
    # One weight off its block's grid, and the matrix is not int8 blocks.
    off = np.array(weight)
    off[7, 9] += np.float32(1e-4)
    assert int8_blocks(mx.array(off)) is None


def test_affine_blocks_are_found_exactly_and_multiplied():
    weight = _affine_exact(_random((300, 128), 8, 0.05))
    q, scales, biases = affine_blocks(weight)
    want = (q.reshape(300, 4, 32).astype(np.float64) * scales[..., None] + biases[..., None]).reshape(300, 128)
    np.testing.assert_array_equal(want, np.array(weight).astype(np.float64))  # the same weights, exactly
    assert int8_blocks(weight) is None  # (a minimum per block is not a multiple of the scale)
    copy = cpu_linear.narrow_copy(weight)
    assert [a.dtype for a in copy] == [mx.int8, mx.float32, mx.float32]
    x = _random((5, 128), 9)
    np.testing.assert_allclose(np.array(cpu_linear.narrow_linear(x, copy)), np.array(x @ weight.T), rtol=1e-5, atol=1e-5)
    off = np.array(weight)
    off[3, 40] += np.float32(1e-5)
    assert affine_blocks(mx.array(off)) is None


EXACT = {"float16": lambda w: w, "int8": _int8_exact, "affine": _affine_exact}
PARTS = {"float16": 1, "int8": 2, "affine": 3}  # arrays in each kind of copy


@pytest.mark.parametrize("make_copy", list(EXACT))
def test_a_row_gets_the_same_result_to_the_bit_whatever_rows_share_the_call(make_copy, monkeypatch):
    weight = EXACT[make_copy](_random((999, 640), 4, 0.05))
    copy = cpu_linear.narrow_copy(weight)
    assert len(copy) == PARTS[make_copy]
    rows = _random((16, 640), 5)
    together = np.array(cpu_linear.narrow_linear(rows, copy))
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_linear, "default_threads", lambda: threads)
        for i in range(16):
            alone = np.array(cpu_linear.narrow_linear(rows[i : i + 1], copy))[0]
            assert np.array_equal(alone, together[i])


def test_float32_weights_in_a_fixed_order(monkeypatch):
    """`fixed_order_weight`: a float32 weight itself in the primitive (where the process's BLAS would
    round by the row count), within float32 rounding of MLX's product and the same bits for a row
    whatever rows share the call; used by plain linear layers only where that BLAS is loaded."""
    weight = _random((37, 100), 8)  # K = 100: a tail past the 16-wide chunks
    copy = cpu_linear.fixed_order_weight(weight) or (weight,)
    rows = _random((16, 100), 9)
    together = cpu_linear.narrow_linear(rows, copy)
    np.testing.assert_allclose(np.array(together), np.array(rows @ weight.T), rtol=1e-5, atol=1e-5)
    for i in (0, 9, 15):
        assert mx.array_equal(cpu_linear.narrow_linear(rows[i : i + 1], copy)[0], together[i])
    layer = nn.Linear(100, 37, bias=False)
    monkeypatch.setattr(cpu_linear, "rounds_by_rows", lambda: False)  # the reference BLAS: MLX's own
    assert cpu_linear.cpu_weight(layer, rows) is None
    monkeypatch.setattr(cpu_linear, "rounds_by_rows", lambda: True)  # MKL: ours
    assert cpu_linear.cpu_weight(layer, rows)[0] is layer.weight
    assert cpu_linear.cpu_weight(layer, rows.astype(mx.float16)) is None


def test_the_primitive_runs_in_compiled_functions_and_has_the_inputs_gradient():
    weight, affine = _int8_exact(_random((256, 64), 6, 0.1)), _affine_exact(_random((256, 64), 6, 0.1))
    for copy, wide in ((cpu_linear.narrow_copy(weight), weight), (cpu_linear.narrow_copy(affine), affine),
                       ((weight.astype(mx.float16),), weight.astype(mx.float16).astype(mx.float32))):
        x = _random((3, 64), 7)
        compiled = mx.compile(lambda a: mx.tanh(cpu_linear.narrow_linear(a * 2, copy)))
        assert np.array_equal(np.array(compiled(x)), np.array(mx.tanh(cpu_linear.narrow_linear(x * 2, copy))))
        grad = mx.grad(lambda a: (cpu_linear.narrow_linear(a, copy) ** 2).sum())(x)
        want = mx.grad(lambda a: ((a @ wide.T) ** 2).sum())(x)
        np.testing.assert_allclose(np.array(grad), np.array(want), rtol=1e-4, atol=1e-4)


def test_a_float32_weight_multiplied_as_itself_has_its_gradient():
    """`fixed_order_weight` hands the parameter itself to the primitive, so training through it (a
    drafter's layers in `dflash train`, where MKL is loaded) needs the weight's gradient as well as
    the input's: both are MLX's own products' within float32 rounding, over inputs with batch axes."""
    weight, x = _random((24, 48), 10), _random((2, 5, 48), 11)

    def loss(w, a, product):
        return (mx.tanh(product(a, w)) ** 2).sum()

    ours = mx.grad(loss, argnums=(0, 1))(weight, x, lambda a, w: cpu_linear.narrow_linear(a, (w,)))
    mlx = mx.grad(loss, argnums=(0, 1))(weight, x, lambda a, w: a @ w.T)
    for got, want in zip(ours, mlx):
        assert mx.abs(want).max().item() > 0
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)


def test_a_drafter_trains_through_the_primitive_as_through_mlx(qwen3_pair, monkeypatch):
    """With a BLAS that rounds by rows loaded (as `dflash train` loads MKL), a drafter's layers go
    through the primitive: every weight gets the gradient it gets through MLX's products (they got
    none before, which left all but the drafter's input projection and norms untrained)."""
    from dataclasses import replace

    from mlx.utils import tree_flatten

    from dflash_core.loading import load_target
    from dflash_core.train import TrainOptions, block_logits, new_drafter

    monkeypatch.setattr(cpu_linear, "rounds_by_rows", lambda: True)
    target, tokenizer, _ = load_target(qwen3_pair[0])
    opts = TrainOptions(target="x", data=None, out=None, layers=2, head_dim=16, heads=4, kv_heads=2,
                        intermediate_size=96)
    drafter = new_drafter(target, tokenizer, opts.with_new_drafter_defaults())
    tokens = mx.array(tokenizer.encode("A sequence long enough to anchor several blocks in it."), dtype=mx.int32)
    taps = target.forward(tokens[None], target.make_cache(16), drafter.config.target_layer_ids).tapped_hidden
    anchors = mx.array([3, 7, 11], dtype=mx.int32)
    layer = drafter.layers[0].self_attn.q_proj
    assert cpu_linear.cpu_weight(layer, mx.zeros((1, layer.weight.shape[1])))[0] is layer.weight

    def grads(model):
        loss = lambda m: (block_logits(m, target, taps, tokens, anchors) ** 2).mean()  # noqa: E731
        return dict(tree_flatten(nn.value_and_grad(model, loss)(model)[1]))

    ours, mlx = grads(drafter), grads(drafter.with_kernels(replace(drafter.kernels, cpu_narrow_linears=False)))
    assert ours.keys() == mlx.keys()
    for name, want in mlx.items():
        assert mx.abs(want).max().item() > 0, name
        np.testing.assert_allclose(np.array(ours[name]), np.array(want), rtol=1e-3, atol=1e-6, err_msg=name)


def test_bad_inputs_are_refused_with_the_reason(primitive):
    with pytest.raises(ValueError, match="float16"):
        primitive.half_linear(mx.zeros((1, 64)), mx.zeros((8, 64)), 1)  # a float32 weight
    with pytest.raises(ValueError, match="scales"):
        primitive.int8_linear(mx.zeros((1, 64)), mx.zeros((8, 64), dtype=mx.int8), mx.zeros((8, 1)), 1)


def _narrow_engine(pair, make_copy: str) -> Engine:
    engine = load_engine(str(pair[0]), str(pair[1]), prefill_chunk=16)
    if make_copy != "float16":  # the target's projections as a GGUF's Q8_0 or Q4_K would leave them
        for layer in engine.target.layers:
            for _, module in layer.named_modules():
                if type(module) is nn.Linear and module.weight.shape[1] % 32 == 0:
                    module.weight = EXACT[make_copy](module.weight)
    assert engine.target.narrow_linears == 0  # the tiny model's layers are below MIN_PARAMETERS
    assert engine.target.use_narrow_linears(0) > 0
    copies = [(m.weight.shape[1], len(m[cpu_linear.NARROW_WEIGHT])) for layer in engine.target.layers
              for _, m in layer.named_modules() if cpu_linear.NARROW_WEIGHT in m]
    # int8 copies for the weights made int8 blocks (K a multiple of 32), float16 for the others
    kind = PARTS[make_copy]
    assert all(n == (kind if K % 32 == 0 else 1) for K, n in copies)
    return engine


@pytest.mark.parametrize("make_copy", list(EXACT))
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_speculation_with_the_primitive_is_lossless(request, family, make_copy):
    engine = _narrow_engine(request.getfixturevalue(f"{family}_pair"), make_copy)
    prompt = sample_prompt(engine)
    proj = next(m for _, m in engine.target.layers[-1].named_modules() if cpu_linear.NARROW_WEIGHT in m)
    assert matmul.path_for(proj, mx.zeros((1, 1, proj.weight.shape[1])), engine.target.kernels) == "cpu"
    assert_verify_is_single_steps(engine.target, prompt, sample_prompt(engine)[:16])
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=7)):
        alone = tokens(engine.generate(prompt, max_tokens=64, sampling=sampling, speculative=False, stop_token_ids=set()))
        spec = tokens(engine.generate(prompt, max_tokens=64, sampling=sampling, speculation="on", stop_token_ids=set()))
        assert spec == alone
    # Every acceptance length 0..15 (16-row verifies against 1-row steps), and rows batched together.
    assert_every_acceptance_length_is_lossless(engine, prompt)
    assert_batched_rows_are_as_alone(engine, prompt, 40)


def test_prefill_and_the_option_off_keep_mlx_product(qwen3_pair):
    engine = load_engine(str(qwen3_pair[0]), str(qwen3_pair[1]))
    engine.target.use_narrow_linears(0)
    proj = engine.target.layers[0].mlp.down_proj
    x = mx.zeros((1, 1, proj.weight.shape[1]))
    assert matmul.path_for(proj, x, engine.target.prefill_kernels) == "mlx"
    assert matmul.path_for(proj, x, KernelOptions(cpu_narrow_linears=False)) == "mlx"
    assert matmul.path_for(proj, x.astype(mx.float16), engine.target.kernels) == "mlx"  # not a float32 input
    assert proj.weight.dtype == mx.float32 and "weight" in dict(proj.parameters())
    assert cpu_linear.NARROW_WEIGHT not in dict(proj.parameters())  # the copy is never saved nor trained
