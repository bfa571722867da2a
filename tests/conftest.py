"""Shared fixtures: tiny random target/drafter pairs, built once per session."""

import mlx.core as mx
import pytest

from dflash_core.synthetic import tiny_pair

# Tests compare exact numbers; keep them on the CPU even where a GPU exists.
mx.set_default_device(mx.cpu)


def _pair(tmp_path_factory, family):
    return tiny_pair(tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory):
    return _pair(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def qwen3_5_pair(tmp_path_factory):
    return _pair(tmp_path_factory, "qwen3_5")


@pytest.fixture(scope="session")
def qwen3_5_moe_pair(tmp_path_factory):
    return _pair(tmp_path_factory, "qwen3_5_moe")


@pytest.fixture(scope="session")
def gemma4_pair(tmp_path_factory):
    return _pair(tmp_path_factory, "gemma4")


@pytest.fixture
def tiny_pair_factory(tmp_path_factory):
    """callable(family, **drafter_kwargs) -> (target_dir, drafter_dir) in a fresh dir."""

    def build(family, **drafter_kwargs):
        return tiny_pair(tmp_path_factory.mktemp(f"{family}_pair"), family, **drafter_kwargs)

    return build
