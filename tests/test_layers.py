"""The package's layers, enforced: launch -> cli -> server -> engine -> adapters/drafter/cache -> kernels.

Every import between the project's modules (at the top of a file or inside a function) is read
from the source: the library (`dflash_core` outside `cli/`) never imports the command line or the
HTTP layer, the HTTP layer never imports the command line, only `cli/serve.py` imports the HTTP
layer, and no two modules import each other in a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"dflash_core": ROOT / "dflash_core", "dflash_server": ROOT / "server"}


def module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(PACKAGES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(package: str, path: Path) -> set[str]:
    """Project modules `path` imports, resolved to module names (a package counts as its
    `__init__`; `from . import x` as the module x)."""
    name = module_name(package, path)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p, f): (p, f) for p, folder in PACKAGES.items() for f in folder.rglob("*.py")}
    edges = {}
    for name, (package, path) in modules.items():
        edges[name] = {m for m in project_imports(package, path) if m in modules and m != name}
    return edges


def layer(module: str) -> str:
    if module == "dflash_core.launch":  # the `dflash` entry point: loads the BLAS before MLX, then the CLI
        return "entry"
    if module.startswith("dflash_core.cli"):
        return "cli"
    if module.startswith("dflash_server"):
        return "server"
    return "library"


def test_no_module_imports_a_layer_above_it():
    rank = {"library": 0, "server": 1, "cli": 2, "entry": 3}
    upward = [(m, d) for m, deps in graph().items() for d in deps if rank[layer(d)] > rank[layer(m)]]
    assert upward == []


def test_only_serve_imports_the_http_layer():
    importers = {m for m, deps in graph().items() if layer(m) == "cli" and any(layer(d) == "server" for d in deps)}
    assert importers == {"dflash_core.cli.serve"}


def test_no_import_cycles():
    edges = graph()
    # A package's __init__ re-exporting its own modules is not a cycle of the layers.
    edges = {m: {d for d in deps if not (m.endswith(".__init__") or d == m.rsplit(".", 1)[0] and m.startswith(d))}
             for m, deps in edges.items()}
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(edges.get(m, ())):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_checker_sees_imports_inside_functions():
    """The rule covers lazy imports too: bench.py once imported the CLI inside a function."""
    edges = graph()
    assert "dflash_core.loading" in edges["dflash_core.cli.generate"]  # imported inside run_generate
