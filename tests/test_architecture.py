"""The house rules, checked on the source: imports point one way through the layers the README draws, no
package imports another package's private modules or names, and no module imports itself in a cycle."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "trainledger"

# Lowest first; a module may import from its own layer and the layers below, never above (README "Design").
# A name is a top-level module or package of trainledger, or a dotted part of one where a package spans two
# layers (its pure transforms below, the code that runs torch above); the longest name that matches wins.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "units", "ledger", "checks", "signals"),
    ("declared", "analytic", "allocator", "devices", "remat._solvers", "shard"),
    ("workload", "inventory", "trace", "record", "measure", "state", "shard._observe", "remat"),
    ("examples", "hf", "anymodel", "vision", "sources", "shard.launch"),
    ("report",),
    ("integrations",),  # the framework callbacks write the HTML page beside the ledger
    ("commands", "cli"),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


@functools.cache
def _source(name: str) -> tuple[str, ast.Module]:
    """A module's text and syntax tree, parsed once for every rule (the tree is only read)."""
    text = MODULES[name].read_text()
    return text, ast.parse(text)


@functools.cache
def _imports(name: str) -> tuple[tuple[str, str | None, int], ...]:
    """``(module imported, name imported from it or None, line)`` for every import of the package."""
    path = MODULES[name]
    _, tree = _source(name)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if module == PACKAGE or module.startswith(PACKAGE + "."):
                for alias in node.names:
                    found.append((module, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.append((alias.name, None, node.lineno))
    return tuple(found)


def _layer_name(module: str) -> str | None:
    """The longest name in LAYERS that ``trainledger.x.y`` falls under, or None for the package itself."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER_OF:
            return ".".join(parts[:n])
    return None if not parts else parts[0]


def _private_owner(module: str) -> str | None:
    """The package whose private part ``module`` is (``trainledger.remat`` for ``trainledger.remat._plan``)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_"):
            return ".".join(parts[:i])
    return None


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _upward_imports() -> set[str]:
    found = set()
    for name in MODULES:
        here = _layer_name(name)
        if here is None or (MODULES[name].name == "__init__.py" and name.count(".") == 1):
            continue  # a package's __init__ re-exports the public surface of its parts
        for module, imported, _ in _imports(name):
            target = _layer_name(f"{module}.{imported}" if imported and f"{module}.{imported}" in MODULES else module)
            if target is not None and target in LAYER_OF and here in LAYER_OF and LAYER_OF[target] > LAYER_OF[here]:
                found.add(f"{name} -> {module}")
    return found


def _private_imports() -> set[str]:
    found = set()
    for name in MODULES:
        for module, imported, _ in _imports(name):
            owner = _private_owner(module)
            if owner is not None and not _inside(name, owner):
                found.add(f"{name} -> {module}")
            if imported is not None and imported.startswith("_") and imported != "__version__":
                package = module if MODULES.get(module, Path()).name == "__init__.py" else module.rpartition(".")[0]
                if not _inside(name, package):
                    found.add(f"{name} -> {module}.{imported}")
    return found


def _cyclic_imports() -> set[str]:
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        deps = set()
        for module, imported, _ in _imports(name):
            if imported is not None and f"{module}.{imported}" in MODULES:
                deps.add(f"{module}.{imported}")
            elif module in MODULES:
                deps.add(module)
        graph[name] = deps - {name}
    # a package's __init__ importing its own submodules is how it builds its surface, not a cycle
    for name in graph:
        if MODULES[name].name == "__init__.py":
            graph[name] = {d for d in graph[name] if not _inside(d, name)}
    return {" <-> ".join(c) for c in _cycles(graph)}


def _readme_layers() -> list[tuple[str, ...]]:
    """The layers the README's "Design" drawing shows, top first, in LAYERS' spelling (``shard/launch``:
    ``shard.launch``). A line starting with ``←`` opens a layer; an indented line continues it; the names
    are the comma-separated words before the description (two spaces or more)."""
    text = (SRC.parent / "README.md").read_text()
    block = text.split("## Design", 1)[1].split("```", 2)[1]
    layers: list[list[str]] = []
    for line in block.strip("\n").splitlines():
        names = re.split(r"\s{2,}", line.strip().removeprefix("← "))[0]
        if not layers or line.strip().startswith("←"):
            layers.append([])
        layers[-1] += [n.strip().rstrip("/").replace("/", ".") for n in names.split(",") if n.strip()]
    return [tuple(layer) for layer in layers]


def test_the_readme_draws_the_layers_checked_here():
    assert [set(layer) for layer in _readme_layers()] == [set(layer) for layer in LAYERS]


def test_every_module_is_in_a_layer():
    units = {_layer_name(m) for m in MODULES} - {None}
    assert units <= set(LAYER_OF), f"modules in no layer: {sorted(units - set(LAYER_OF))}"


@pytest.mark.parametrize(
    "rule, found",
    [
        ("imports point down the layers", _upward_imports),
        ("no private import across packages", _private_imports),
        ("no import cycle", _cyclic_imports),
    ],
)
def test_house_rule(rule, found):
    breaches = sorted(found())  # each "importer -> imported"
    assert not breaches, f"{rule}: " + "; ".join(breaches)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


MAX_FUNCTION_LINES = 80


def _long_functions() -> set[str]:
    """Functions longer than the limit whose first body line is not a ``# long:`` comment giving the reason."""
    found = set()
    for name in MODULES:
        text, tree = _source(name)
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 <= MAX_FUNCTION_LINES:
                    continue
                body_start = node.body[0].lineno - 1
                if not any(line.strip().startswith("# long:") for line in lines[node.lineno : body_start + 2]):
                    found.add(f"{name}.{node.name}")
    return found


def test_no_function_over_the_limit_without_a_reason():
    found = sorted(_long_functions())
    assert not found, f"over {MAX_FUNCTION_LINES} lines, split or say why in a '# long:' comment: {found}"
