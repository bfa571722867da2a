"""Aggregate tok/s against streams from benchmarks/gpu_batch.py reports, one line per mode and run.

    python benchmarks/plot_batching.py docs/gpu/gpu_batch_bf16_per_row_attention.json \\
        docs/gpu/gpu_batch_bf16_attention_rows.json docs/gpu/gpu_batch_bf16.json --out docs/gpu/batching_bf16.png

Needs matplotlib (the `bench` extra). Each report's label is its file name; `--quant bf16` keeps
one quantization's rows of reports that hold several.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quant", help="plot only this quantization's rows (a report may hold bf16 and 4bit)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for path in args.reports:
        report = json.loads(path.read_text())
        rows = report["rows"]
        if "medians" in report:  # a report of several rounds (gpu_batch.py --rounds): each count's medians
            rows = [{"quant": m["quant"], "streams": m["streams"],
                     **{k: {"aggregate_tok_s": m[k]} for k in ("dflash", "target", "mlx_lm") if k in m}}
                    for m in report["medians"]]
        rows = sorted((r for r in rows if args.quant in (None, r.get("quant"))), key=lambda r: r["streams"])
        streams = [r["streams"] for r in rows]
        style = "-" if path is args.reports[-1] else "--"
        ax.plot(streams, [r["dflash"]["aggregate_tok_s"] for r in rows], "s" + style, label=f"DFlash 6.4 tok/cycle ({path.stem})")
        ax.plot(streams, [r["target"]["aggregate_tok_s"] for r in rows], "o" + style, label=f"target alone ({path.stem})")
        if path is args.reports[-1] and all("aggregate_tok_s" in r.get("mlx_lm", {}) for r in rows):
            ax.plot(streams, [r["mlx_lm"]["aggregate_tok_s"] for r in rows], "^:", label="mlx-lm BatchGenerator")
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, [str(s) for s in streams])
    ax.set(xlabel="concurrent streams", ylabel="aggregate tokens/s",
           title=f"{report['shape']} on {report['device']}, {report['context']}-token prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
