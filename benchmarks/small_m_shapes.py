"""What gpu_small_m.py and torch_small_m.py share (no MLX or torch here): the shapes they
measure, Qwen3.5-9B's products as the engine makes them (projections sharing an input stacked):
GatedDeltaNet qkv+z+b+a, attention q+k+v, MLP gate+up, MLP down, the o/out projections, the LM
head, as (N, K) of `x[M, K] @ W[N, K].T`; and how they print and save rows."""

import json

SHAPES = {
    "gdn_in 12352x4096": (12352, 4096),
    "attn_qkv 10240x4096": (10240, 4096),
    "gate_up 24576x4096": (24576, 4096),
    "down 4096x12288": (4096, 12288),
    "out 4096x4096": (4096, 4096),
    "lm_head 248320x4096": (248320, 4096),
}
ROWS = (1, 2, 4, 8, 16, 32)
ROTATION_BYTES = 1.0e9  # distinct weights per shape, so that nothing is read from L2


def emitter(path=None):
    """A function that prints a row as one JSON line and appends it to `path` (if given)."""
    out = open(path, "w") if path else None

    def emit(row: dict) -> None:
        line = json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    return emit
