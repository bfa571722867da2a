"""Compiled blocks: `mx.compile` of a forward's pieces, safe against MLX's trace cache.

MLX keys its traces of a compiled function by the Python function's id, and a trace could
outlive the function: once an adapter was freed, a new block allocated at the same address
(another model of the same shapes, or the same model loaded again) was seen running the old
block's trace, with the old model's weights in it (tests/test_compiled_blocks.py). So what
mx.compile gets is a small entry point kept for the life of the process, whose id is therefore
never reused; it reaches the block (held by its owner, freed with it) through a weak reference.

A trace holds the weights it read as constants. A target's weights never change once loaded; a
drafter's can (`dflash train`, weights loaded into the same object), so `WeightedBlock` checks that
its module still holds the arrays it was traced with and traces again where it does not.
"""

from __future__ import annotations

import weakref
from operator import getitem, is_
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

_ENTRY_POINTS: list = []

# Decode and verify forwards, drafts and the context a cycle adds (at most this many tokens) run
# each layer as a few compiled functions: building a graph of thousands of small ops on the host
# otherwise bounds a step. Longer ones (prefill chunks, batches) run op by op: each new shape is a
# new trace.
COMPILED_MAX_TOKENS = 16


def entry_point(block):
    """A function calling `block`, never freed, that does not keep `block` alive."""
    ref = weakref.ref(block)

    def call(*args):
        return ref()(*args)

    _ENTRY_POINTS.append(call)
    return call


def _slots(tree, parent=None, key=None):
    """(container, key, value) of every module, list and array under `tree` (a module's dicts and
    lists): what `parent[key] is value` checks to see that nothing in it was replaced."""
    if parent is not None:
        yield parent, key, tree
    if isinstance(tree, dict):
        for k, v in tree.items():
            if isinstance(v, (dict, list, mx.array)):
                yield from _slots(v, tree, k)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            if isinstance(v, (dict, list, mx.array)):
                yield from _slots(v, tree, i)


class WeightedBlock:
    """`mx.compile(make())`, where the block `make` builds reads `module`'s weights: traced again
    (a new block, a new entry point) once any array or submodule of `module` was replaced since
    its trace. The old trace stays in MLX's cache with the weights it held: replacing the weights
    of a module that runs compiled blocks is for loading and training, not for every step."""

    def __init__(self, module: nn.Module, make: Callable[[], Callable]):
        self.module, self.make = module, make
        self.block = self.fn = None
        self.parents: tuple = ()  # with `keys` and `values`: every slot under the module, as traced
        self.keys: tuple = ()
        self.values: tuple = ()

    def __call__(self, *args):
        # (The check loops in C: a drafter calls some fifteen blocks a cycle.)
        if self.fn is None or not all(map(is_, map(getitem, self.parents, self.keys), self.values)):
            self.parents, self.keys, self.values = zip(*_slots(self.module))
            self.block = self.make()
            self.fn = mx.compile(entry_point(self.block))
        return self.fn(*args)


class BlockCache:
    """A module's `WeightedBlock`s by key (kernel options among it), kept as a plain attribute of
    the module: a dict attribute would join its parameters."""

    def __init__(self):
        self.blocks: dict = {}

    def get(self, module: nn.Module, key, make: Callable[[], Callable]) -> WeightedBlock:
        block = self.blocks.get(key)
        if block is None:
            block = self.blocks[key] = WeightedBlock(module, make)
        return block
