"""Prompt corpora for `dflash train`, built from what every machine with Python has.

- code: the heads of functions and classes in the standard library's own sources (signature,
  docstring, first lines), continued by the target as code;
- prose: openings of the paragraphs of Python's documentation topics (`pydoc_data`, shipped with
  CPython) and of the standard library's module docstrings;
- chat: the bundled prompt sets (the demo's, `dflash bench`'s) and questions about documented
  standard-library functions;
- structured: JSON records about those functions, opened for the target to complete (the shape
  of an agent's tool call or a structured answer).

Prompts are deduplicated on their normalised text (case and whitespace folded), and each one's
split is a hash of that text: a held-out prompt never appears in training, however the corpus is
rebuilt, grown or ordered, and two spellings of one prompt land on the same side.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import re
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

CATEGORIES = ("code", "prose", "chat", "structured")
HELD_OUT = 0.05  # share of prompts held out by default
MAX_CHARS = 1500  # longer prompts are cut (code at a line end)

Prompt = Union[str, list]  # plain text, or chat messages


@dataclass(frozen=True)
class CorpusPrompt:
    prompt: Prompt
    category: str
    source: str
    split: str  # "train" or "held_out"


def normalised(prompt: Prompt) -> str:
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return re.sub(r"\s+", " ", text).strip().lower()


def split_of(prompt: Prompt, held_out: float = HELD_OUT) -> str:
    """'held_out' for about `held_out` of all prompts, decided by the prompt's text alone."""
    digest = int(hashlib.sha256(normalised(prompt).encode()).hexdigest()[:12], 16)
    return "held_out" if digest % 1_000_000 < held_out * 1_000_000 else "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if "site-packages" not in path.parts and "dist-packages" not in path.parts:
            yield path


def _parsed(path: Path) -> Optional[tuple[list[str], ast.Module]]:
    try:
        text = path.read_text(encoding="utf-8")
        return text.splitlines(), ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None


def code_prompts(root: Path) -> Iterator[tuple[str, str]]:
    """(prompt, source): each function's or class's head, up to half its lines (at least the
    signature and four more), so the target continues real code."""
    for path in _python_files(root):
        parsed = _parsed(path)
        if parsed is None:
            continue
        lines, module = parsed
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.end_lineno:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
                length = node.end_lineno - start
                if length < 6:
                    continue
                head = "\n".join(lines[start: start + max(5, length // 2)])
                yield _cut(_dedent(head)), f"{path.relative_to(root)}:{node.lineno}"


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines)


def _cut(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return text
    return text[: text.rfind("\n", 0, MAX_CHARS) if "\n" in text[:MAX_CHARS] else MAX_CHARS]


def _paragraph_openings(text: str, source: str) -> Iterator[tuple[str, str]]:
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        if len(paragraph) >= 120 and not paragraph.startswith((">>>", "...", "$")):
            yield _cut(paragraph[: max(60, len(paragraph) // 3)]), source


def prose_prompts(root: Path) -> Iterator[tuple[str, str]]:
    """(prompt, source): paragraph openings of the documentation topics, then of module docstrings."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its docs data
        topics = {}
    for name in sorted(topics):
        yield from _paragraph_openings(topics[name], f"pydoc_data:{name}")
    for path in _python_files(root):
        parsed = _parsed(path)
        if parsed is not None:
            yield from _paragraph_openings(ast.get_docstring(parsed[1]) or "", f"{path.relative_to(root)}:doc")


def _documented_functions(root: Path) -> Iterator[tuple[str, str, list[str], str, str]]:
    """(module, name, arguments, first docstring line, source) of public module-level functions."""
    for path in _python_files(root):
        if any(part.startswith(("test", "_", "idle")) for part in path.relative_to(root).parts):
            continue
        parsed = _parsed(path)
        if parsed is None:
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in parsed[1].body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0]
                doc = " ".join(doc.split())
                if len(doc) >= 20:
                    args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
                    yield module, node.name, args, doc, f"{path.relative_to(root)}:{node.lineno}"


def chat_prompts(root: Path) -> Iterator[tuple[Prompt, str]]:
    """(prompt, source): the bundled prompt sets, then questions about documented functions."""
    from .bench_prompts import PROMPTS
    from .demo import DEMO_PROMPTS

    for line in DEMO_PROMPTS.read_text().splitlines():
        if line.strip():
            yield line.strip().replace("\\n", "\n"), "demo/prompts.txt"
    for p in PROMPTS:
        if not p.tools:  # a prompt with tools needs them rendered; the bench serves those
            yield p.messages, f"bench_prompts:{p.set}/{p.name}"
    for module, name, args, doc, source in _documented_functions(root):
        yield (f"What does {module}.{name}({', '.join(args)}) do in Python, and when would you use it? "
               f"The documentation starts: \"{doc[:300]}\""), source


def structured_prompts(root: Path) -> Iterator[tuple[str, str]]:
    """(prompt, source): a JSON record of a documented function, opened for the target to finish."""
    for module, name, args, doc, source in _documented_functions(root):
        record = {"tool": "describe_function", "module": module, "name": name, "arguments": args}
        opened = json.dumps(record)[:-1] + ', "summary": "'
        yield f"{doc[:300]}\n{opened}", source


SOURCES = {"code": code_prompts, "prose": prose_prompts, "chat": chat_prompts, "structured": structured_prompts}


def build_corpus(categories: Iterable[str] = CATEGORIES, per_category: Optional[int] = None,
                 held_out: float = HELD_OUT, root: Optional[Path] = None) -> list[CorpusPrompt]:
    """Up to `per_category` distinct prompts of each category (all by default), in a fixed order:
    the categories taken in turn, one prompt each, so that every head of the corpus is balanced
    (a data generation cut short by `dflash train --generation-minutes` covers all of them)."""
    categories = list(categories)
    unknown = [c for c in categories if c not in SOURCES]
    if unknown:
        raise ValueError(f"unknown categories {unknown}; known: {', '.join(CATEGORIES)}")
    root = root or stdlib_root()
    seen: set[str] = set()
    by_category = []
    for category in categories:
        prompts = []
        for prompt, source in SOURCES[category](root):
            key = normalised(prompt)
            if key in seen:
                continue
            seen.add(key)
            prompts.append(CorpusPrompt(prompt, category, source, split_of(prompt, held_out)))
            if per_category is not None and len(prompts) >= per_category:
                break
        by_category.append(prompts)
    return [p for turn in itertools.zip_longest(*by_category) for p in turn if p is not None]


def write_corpus(corpus: list[CorpusPrompt], path: Path) -> None:
    """One JSON object a line: {"prompt" or "messages", "category", "source", "split"}, the form
    `dflash train --data` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for item in corpus:
            record = asdict(item)
            if not isinstance(item.prompt, str):
                record["messages"] = record.pop("prompt")
            f.write(json.dumps(record) + "\n")
