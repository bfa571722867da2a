"""Write the demo drafter's draft vocabulary (dflash_core/demo/gemma-3-270m-dflash/draft_vocab.json):
every token of the training split of the corpus it was trained on (`dflash_core.corpus`, source
stdlib), through the demo target's tokenizer, most frequent first.

The drafter's training responses (the target's continuations of those prompts) were not kept, so
the prompts stand in for them: the same code, prose and chat, the held-out prompts left out (their
continuations are what `dflash bench` measures acceptance on). `dflash train --draft-vocab N`
counts the responses themselves.

    python scripts/demo_draft_vocab.py [--size N] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.corpus import build_corpus  # noqa: E402
from dflash_core.demo import DEMO_DRAFTER, demo_target_dir  # noqa: E402
from dflash_core.draft_vocab import most_frequent, write_draft_vocab  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=65536, help="most tokens kept (default: more than the corpus has)")
    parser.add_argument("--out", type=Path, default=Path(DEMO_DRAFTER))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_target_dir()))
    prompts = [p.prompt for p in build_corpus(sources=["stdlib"]) if p.split == "train"]
    texts = [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in prompts]
    tokens = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids, coverage = most_frequent(tokens, args.size)
    source = (f"scripts/demo_draft_vocab.py: the {len(texts)} training-split prompts of the stdlib corpus, "
              f"{sum(map(len, tokens))} tokens")
    file = write_draft_vocab(args.out, ids, source, coverage)
    print(f"{file}: {len(ids)} token ids, covering {coverage:.2%} of the counted tokens")


if __name__ == "__main__":
    main()
