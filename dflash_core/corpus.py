"""Prompt corpora for `dflash train`, built from what every machine with dflash installed has: the
Python standard library and the bundled prompt sets (source `stdlib`), then the packages dflash
installs with it (source `packages`: numpy, transformers, mlx-lm, pydantic, FastAPI, ...), whose
docstrings hold far more prose about software than the standard library's.

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
rebuilt, grown or ordered, and two spellings of one prompt land on the same side. Within a
category the standard library's prompts come first, so `--sources stdlib` gives the corpus the
shipped drafter was trained on; the packages' prompts depend on the versions installed.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import itertools
import json
import re
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

CATEGORIES = ("code", "prose", "chat", "structured")
SOURCE_NAMES = ("stdlib", "packages")
# Installed with dflash (directly or through mlx-lm, transformers and FastAPI), in this order.
PACKAGES = ("numpy", "transformers", "huggingface_hub", "mlx_lm", "mlx", "pydantic", "fastapi", "starlette",
            "jinja2", "httpx", "anyio", "uvicorn", "yaml", "tqdm")
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


@dataclass(frozen=True)
class Tree:
    """Python files to take prompts from: `files`, named (and made module names) relative to `root`;
    prose from every public docstring (`all_docstrings`) or from module docstrings only."""

    root: Path
    files: tuple[Path, ...]
    all_docstrings: bool = False


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_tree(root: Optional[Path] = None) -> Tree:
    root = root or stdlib_root()
    return Tree(root, tuple(p for p in sorted(root.rglob("*.py"))
                            if "site-packages" not in p.parts and "dist-packages" not in p.parts))


def package_trees(names: Iterable[str] = PACKAGES) -> list[Tree]:
    """The installed packages among `names` (those missing are skipped), each relative to the
    directory that holds it, so that its modules are named as they are imported."""
    trees = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = Path(next(iter(spec.submodule_search_locations)))
        trees.append(Tree(folder.parent, tuple(sorted(folder.rglob("*.py"))), all_docstrings=True))
    return trees


def _parsed(path: Path) -> Optional[tuple[list[str], ast.Module]]:
    try:
        text = path.read_text(encoding="utf-8")
        return text.splitlines(), ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None


def code_prompts(tree: Tree) -> Iterator[tuple[str, str]]:
    """(prompt, source): each function's or class's head, up to half its lines (at least the
    signature and four more), so the target continues real code."""
    root = tree.root
    for path in tree.files:
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


# A docstring paragraph that is a parameter list, a section heading, markup or code, not prose.
NOT_PROSE = re.compile(r"^(#|\.\.|:|[A-Z][a-z]+:|Args\b|Arguments\b|Parameters\b|Params\b|Returns?\b|Yields?\b"
                       r"|Raises\b|Examples?\b|Attributes\b|Notes?\b|See [Aa]lso\b)|-{3,}|={3,}|```")


def _paragraph_openings(text: str, source: str, strict: bool = False) -> Iterator[tuple[str, str]]:
    """The first third of each paragraph of 120 characters or more; `strict`: only paragraphs
    that read as sentences (a capital first, a full stop, no section or parameter markup)."""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        if len(paragraph) < 120 or paragraph.startswith((">>>", "...", "$")):
            continue
        if strict and (not paragraph[0].isupper() or ". " not in paragraph or NOT_PROSE.search(paragraph)):
            continue
        yield _cut(paragraph[: max(60, len(paragraph) // 3)]), source


def pydoc_prose() -> Iterator[tuple[str, str]]:
    """(prompt, source): paragraph openings of Python's documentation topics."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its docs data
        topics = {}
    for name in sorted(topics):
        yield from _paragraph_openings(topics[name], f"pydoc_data:{name}")


def prose_prompts(tree: Tree) -> Iterator[tuple[str, str]]:
    """(prompt, source): paragraph openings of module docstrings, and of public classes' and
    functions' where the tree takes all its docstrings (the packages; the standard library keeps
    its module docstrings only, so that `--sources stdlib` stays the shipped drafter's corpus)."""
    for path in tree.files:
        parsed = _parsed(path)
        if parsed is None:
            continue
        source, every = str(path.relative_to(tree.root)), tree.all_docstrings
        yield from _paragraph_openings(ast.get_docstring(parsed[1]) or "", f"{source}:doc", strict=every)
        if every:
            for node in ast.walk(parsed[1]):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                    yield from _paragraph_openings(ast.get_docstring(node) or "", f"{source}:{node.lineno}", strict=True)


def _documented_functions(tree: Tree) -> Iterator[tuple[str, str, list[str], str, str]]:
    """(module, name, arguments, first docstring line, source) of public module-level functions."""
    root = tree.root
    for path in tree.files:
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


def bundled_chat() -> Iterator[tuple[Prompt, str]]:
    """(prompt, source): the bundled prompt sets (the demo's, `dflash bench`'s)."""
    from .bench_prompts import PROMPTS
    from .demo import DEMO_PROMPTS

    for line in DEMO_PROMPTS.read_text().splitlines():
        if line.strip():
            yield line.strip().replace("\\n", "\n"), "demo/prompts.txt"
    for p in PROMPTS:
        if not p.tools:  # a prompt with tools needs them rendered; the bench serves those
            yield p.messages, f"bench_prompts:{p.set}/{p.name}"


def chat_prompts(tree: Tree) -> Iterator[tuple[Prompt, str]]:
    """(prompt, source): questions about documented functions."""
    for module, name, args, doc, source in _documented_functions(tree):
        yield (f"What does {module}.{name}({', '.join(args)}) do in Python, and when would you use it? "
               f"The documentation starts: \"{doc[:300]}\""), source


def structured_prompts(tree: Tree) -> Iterator[tuple[str, str]]:
    """(prompt, source): a JSON record of a documented function, opened for the target to finish."""
    for module, name, args, doc, source in _documented_functions(tree):
        record = {"tool": "describe_function", "module": module, "name": name, "arguments": args}
        opened = json.dumps(record)[:-1] + ', "summary": "'
        yield f"{doc[:300]}\n{opened}", source


SOURCES = {"code": code_prompts, "prose": prose_prompts, "chat": chat_prompts, "structured": structured_prompts}
# What a category takes once, before its trees: the documentation topics, the bundled prompt sets.
FIRST = {"prose": pydoc_prose, "chat": bundled_chat}


def _category(category: str, trees: list[Tree], first: bool) -> Iterator[tuple[Prompt, str]]:
    if first and category in FIRST:
        yield from FIRST[category]()
    for tree in trees:
        yield from SOURCES[category](tree)


def build_corpus(categories: Iterable[str] = CATEGORIES, per_category: Optional[int] = None,
                 held_out: float = HELD_OUT, root: Optional[Path] = None,
                 sources: Iterable[str] = SOURCE_NAMES) -> list[CorpusPrompt]:
    """Up to `per_category` distinct prompts of each category (all by default), in a fixed order:
    the categories taken in turn, one prompt each, so that every head of the corpus is balanced
    (a data generation cut short by `dflash train --generation-minutes` covers all of them).
    `sources`: "stdlib" (the standard library at `root`, and the bundled sets), "packages"."""
    categories, sources = list(categories), list(sources)
    unknown = [c for c in categories if c not in SOURCES]
    if unknown:
        raise ValueError(f"unknown categories {unknown}; known: {', '.join(CATEGORIES)}")
    unknown = [s for s in sources if s not in SOURCE_NAMES]
    if unknown or not sources:
        raise ValueError(f"unknown sources {unknown}; known: {', '.join(SOURCE_NAMES)}")
    trees = ([stdlib_tree(root)] if "stdlib" in sources else []) + (package_trees() if "packages" in sources else [])
    seen: set[str] = set()
    by_category = []
    for category in categories:
        prompts = []
        for prompt, source in _category(category, trees, first="stdlib" in sources):
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
