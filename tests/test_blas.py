"""The fast BLAS: `dflash` loads it before MLX, and MLX's float32 matmuls then go to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from families import ENGINE_FAMILIES

from dflash_core.blas import candidates
from dflash_core.kernels import backend

PROBE = """
import json, sys
from dflash_core.blas import preload, provider
loaded = preload()
import mlx.core as mx
a = mx.ones((64, 64))
print(json.dumps({"loaded": loaded, "provider": provider(), "sum": (a @ a).sum().item()}))
"""


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not candidates(), reason="no fast BLAS on this machine (pip install mkl on x86-64 Linux)")
def test_mlx_matmuls_go_to_the_fast_blas():
    fast = _probe()
    assert fast["loaded"] == candidates()[0]
    assert fast["provider"] == fast["loaded"]  # the symbol MLX calls is the fast library's
    assert fast["sum"] == 64.0 ** 3
    reference = _probe(DFLASH_BLAS="reference")
    assert reference["loaded"] is None and reference["provider"] is None
    assert reference["sum"] == fast["sum"]


def test_too_late_is_a_no_op():
    """Once MLX is loaded its calls are bound: preloading then does nothing."""
    import mlx.core  # noqa: F401

    from dflash_core.blas import preload

    assert preload() is None


@pytest.mark.skipif(not candidates(), reason="no fast BLAS on this machine (pip install mkl on x86-64 Linux)")
@pytest.mark.skipif(backend() != "cpu", reason="the BLAS serves MLX's CPU backend only")
def test_lossless_with_the_fast_blas(request, tmp_path, cpu_kernels):
    """As `dflash serve` runs on Linux, with MKL: every family's verify (Gemma 4's MoE too) gives its
    tokens the logits of single steps to the bit, and speculative output is the target-alone output (greedy, every
    acceptance length, seeded sampling). MKL rounds a product by its row count: before attention's
    products were ours (cpu_attention.cpp) a verify's logits were up to 5e-5 off a decode step's."""
    pairs = [f"{family}={','.join(map(str, request.getfixturevalue(f'{family}_pair')))}"
             for family in [*ENGINE_FAMILIES, "gemma4_moe"]]
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "fast_blas_lossless.py"), str(out),
                           *pairs], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["loaded"] == candidates()[0] and result["provider"] == result["loaded"]
    for family, checks in result["families"].items():
        assert checks == {"verify_difference": 0.0, "context_difference": 0.0, "random_drafter": True,
                          "every_acceptance_length": True, "seeded_sampling": True}, family
