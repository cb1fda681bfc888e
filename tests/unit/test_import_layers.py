"""Every import in backend_src/paged_llm points down the layers, and no import cycle exists.

The imports are read with `ast` (nothing is imported), all of them: module level, under
`if TYPE_CHECKING:` and inside functions, because a lazy or type-only import that points up is
still a dependency a reader has to follow up the stack.

The layers, lowest first (the one list; a new top-level package or module goes into it):

  0. foundation    errors, paths, gc_pauses, processes, device_kind, coercion,
                   structured_output_params, sampling_params, config, sequence (the package's
                   top-level modules: plain data and process helpers)
  1. core          scheduler, KV cache, sessions: torch-free, stdlib and the foundation only
  2. tokenizer     tokenizers, detokenizer, stop strings
  3. sampling      sampler, penalties, noise, verification of speculative proposals, token bitmasks
  3b. structured_output  xgrammar: constraint compiling (worker processes), matchers, step bitmasks
  4. layers        model building blocks and kernels (attention, linear, fused ops)
  5. models        checkpoint configs, loaders, the decoder; lora (PEFT adapters, their device
                   slots, the decoder's per-row updates) beside it
  6. runner        the model runner, its device, tensor parallelism, CUDA graphs
  7. spec_decode   proposers (n-gram, draft model: a runner of its own)
  8. engine        EngineCore, its process, its clients, AsyncLLM, output processing
  9. triton_model  the Triton model: everything that runs inside a Triton stub (codecs, response
                   streams, metrics, the llm model itself)
 10. launcher      what the product runs around tritonserver: launch, the model repository copy,
                   supervision, stub watch, HTTP guard, process utilities
 11. openai        the OpenAI-compatible server (a client of tritonserver)
 12. cli           `paged-llm` commands
 13. model_repository  the Triton model repository template (package data): its model.py shims
 14. testing       what only tests, benchmarks and scripts use (the tritonserver harness, the
                   benchmark workload): the top layer, so no module of the product imports it

A module may import any module of its own layer (the cycle check keeps those acyclic) or of a
layer below. `core` is stricter: besides the foundation it may import only the standard library
(no torch, no third-party package), so the scheduler stays testable and fast without a GPU stack.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "paged_llm"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / "backend_src" / PACKAGE

LAYERS: list[tuple[str, ...]] = [
    (
        "errors",
        "paths",
        "gc_pauses",
        "processes",
        "device_kind",
        "coercion",
        "structured_output_params",
        "sampling_params",
        "config",
        "sequence",
    ),
    ("core",),
    ("tokenizer",),
    ("sampling",),
    ("structured_output",),
    ("layers",),
    ("models", "lora"),
    ("runner",),
    ("spec_decode",),
    ("engine",),
    ("triton_model",),
    ("launcher",),
    ("openai",),
    ("cli",),
    ("model_repository",),
    ("testing",),  # last: nothing of the product may import it (test_testing_is_the_top_layer)
]
LEVEL_OF = {name: level for level, names in enumerate(LAYERS) for name in names}
CORE = "core"
TESTING = "testing"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imported_names(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """Every module `module` imports (absolute dotted names, first-party or not), with the line.
    `from pkg import sub` names the submodule when `pkg.sub` is a module of the package."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in known else source), node.lineno


def _level(module: str) -> int | None:
    """The layer level of a first-party module (the package itself is foundation); None when its
    top-level name is in no layer (test_every_package_has_a_layer reports it)."""
    parts = module.split(".")
    return LEVEL_OF.get(parts[1]) if len(parts) > 1 else 0


def _is_first_party(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """First-party import graph, and every (module, line, imported) pair for the layer checks."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    imports: list[tuple[str, int, str]] = []
    for module, path in modules.items():
        for imported, line in _imported_names(module, path, known):
            if (module, line, imported) not in imports:  # `from x import a, b`: one line
                imports.append((module, line, imported))
            if imported in known and imported != module:
                graph[module].add(imported)
    return graph, imports


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of every strongly connected component of more than one module (Tarjan): a
    shortest one through each of its modules, each a path that returns to its start."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles: list[list[str]] = []
    for component in components:
        seen: set[tuple[str, ...]] = set()
        for member in sorted(component):  # a shortest cycle through each member, once each
            cycle = _cycle_through(graph, set(component), member)
            rotation = min(cycle[i:-1] + cycle[:i] for i in range(len(cycle) - 1))
            if tuple(rotation) not in seen:
                seen.add(tuple(rotation))
                cycles.append(cycle)
    return cycles


def _cycle_through(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest cycle through `start` inside its strongly connected component (breadth-first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in parents:
                    parents[succ] = node
                    next_frontier.append(succ)
        frontier = next_frontier
    raise AssertionError(f"no cycle in component {sorted(component)}")


def test_every_package_has_a_layer() -> None:
    unlisted = sorted({module for module in _modules() if _level(module) is None})
    assert not unlisted, f"add their package to LAYERS in {Path(__file__).name}: {unlisted}"


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph()[0])
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_imports_point_down_the_layers() -> None:
    upward = []
    for module, line, imported in _graph()[1]:
        if not _is_first_party(imported):
            continue
        source, target = _level(module), _level(imported)
        if source is not None and target is not None and target > source:
            upward.append(f"  {module}:{line} imports {imported} (layer {source} -> {target})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_core_imports_only_stdlib_and_the_foundation() -> None:
    core_level = LEVEL_OF[CORE]
    outside = []
    for module, line, imported in _graph()[1]:
        if _level(module) != core_level:
            continue
        if _is_first_party(imported):
            level = _level(imported)
            if level is not None and level <= core_level:
                continue
        elif imported.split(".")[0] in sys.stdlib_module_names:
            continue
        outside.append(f"  {module}:{line} imports {imported}")
    message = "core/ may import only the standard library and the layers at or below it:\n"
    assert not outside, message + "\n".join(outside)


def test_testing_is_the_top_layer() -> None:
    """`testing/` serves tests and benchmarks only: as the top layer alone, the downward rule above
    keeps every product module from importing it."""
    assert LAYERS[-1] == (TESTING,)


def test_the_cycle_finder_finds_cycles() -> None:
    """The checks above pass on a clean tree: this one shows that they can fail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
