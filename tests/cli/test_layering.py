"""The package's import arrows point one way: each module imports only modules of its own layer or
below, and no set of modules imports itself round (every import counts, including those inside
functions, since a function-level import is still a dependency, only a later one, and a
"ster_dist.mod:function" string a rank runs by name).

LAYERS is the one table to edit: module prefixes (relative to ster_dist, `*` allowed in the first
component), bottom to top. A module named by no prefix fails the test, so a new module must be
placed on purpose.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path


PACKAGE = "ster_dist"
CALL_BY_NAME = re.compile(PACKAGE + r"(\.\w+)+:\w+")
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

# bottom to top: (prefixes, why the layer sits where it does)
LAYERS: list[tuple[tuple[str, ...], str]] = [
    (
        ("", "errors", "atomic", "events", "inputs", "running"),
        "leaves: refusals, whole-or-nothing writes, progress events, input files and the running job's "
        "context (its id, its cancellation); import nothing of ours",
    ),
    (
        ("families",),
        "families are data (FamilySpec, name maps, config normalisers); read by the config and by every name-map user",
    ),
    (
        ("checkpoint", "config", "resolve", "tokenizer"),
        "checkpoint and config level: what a model is, read from its files before any weight",
    ),
    (
        ("kernels",),
        "our native CPU kernels (few-row products, paged decode attention), built at first use; torch ops only",
    ),
    (
        ("parallel",),
        "tensor-parallel primitives (ParallelCtx, Shard, sharded linears): every layer takes a context",
    ),
    (
        ("layers",),
        "building blocks shared by the dense model and the experts (feed-forwards, activations)",
    ),
    (("moe",), "mixture of experts: router, experts, dispatch; a layer the decoder places"),
    (("model",), "the decoder and its attention kinds, built from ModelConfig on a ParallelCtx"),
    (
        ("shard", "gguf", "load"),
        "weight I/O above the model: plans, sources, the loader that fills a built model, writers; "
        "toy builds a decoder to name its parameters",
    ),
    (("parity", "workers"), "running a loaded model on one rank and across ranks"),
    (
        ("engine",),
        "the token-level engine: paged KV blocks, prefix cache, scheduler and sampler (driver side) and "
        "the model runner (a rank extension)",
    ),
    (("steer", "adapters", "decide", "tune"), "features over a running model"),
    (
        ("schema",),
        "typed requests, one pydantic model per operation; their validators read a local config.json "
        "and the --layers grammar (steer/layers), never weights",
    ),
    (("session",), "the driver's view of one model run, resolved and loaded on first use"),
    (("ops",), "every operation as a plain function over a session and its typed request"),
    (
        ("batch",),
        "batch inference over Ray Data: replicas of a session's engine answering a dataset's rows",
    ),
    (("protocol",), "job specs and results: typed requests as msgpack, JSON and YAML"),
    (
        ("jobqueue",),
        "the job queue: pool of sessions, journal, lanes, cancellation, retries, the Ray actor",
    ),
    (
        ("api", "chat"),
        "the Python entry point over the job queue, and the terminal chat over a session's engine",
    ),
    (
        ("serve",),
        "the HTTP server: OpenAI's API over the token engine, Ster's serve API over the job queue, replicas",
    ),
    (
        ("cli", "desktop_request", "text_lines"),
        "the command line, generated from the schema, and `ster request` over it: imported by nobody",
    ),
]


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index of the layer holding `module` (a name relative to the package, "" for its
    __init__)."""
    first = module.split(".")[0]
    for index, (prefixes, _) in enumerate(layers):
        if any(fnmatch.fnmatchcase(first, p) if p else module == "" for p in prefixes):
            return index
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports (names relative to the package)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node)
                # `from pkg import mod` imports the module pkg.mod when there is one, else pkg
                names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
                names = [n if _relative(n) in files else base for n in names]
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and CALL_BY_NAME.fullmatch(node.value)
            ):
                # "ster_dist.steer.attach:attach_on_rank", run on the ranks by name: a dependency
                # all the same
                names = [node.value.partition(":")[0]]
            else:
                continue
            for name in names:
                rel = _relative(name)
                # the longest prefix of the name that is one of our modules
                while rel is not None and rel not in files and rel:
                    rel = rel.rpartition(".")[0]
                if rel is not None and rel in files and rel != module:
                    targets.add(rel)
        graph[module] = targets
    return graph


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = [PACKAGE, *module.split(".")] if module else [PACKAGE]
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _relative(name: str) -> str | None:
    if name == PACKAGE:
        return ""
    if name.startswith(PACKAGE + "."):
        return name[len(PACKAGE) + 1 :]
    return None


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, int, str, int]]:
    """(importer, its layer, imported, its layer) for every import of a higher layer."""
    found = []
    for module, targets in sorted(graph.items()):
        low = layer_of(module, layers)
        for target in sorted(targets):
            high = layer_of(target, layers)
            if low is not None and high is not None and high > low:
                found.append((module, low, target, high))
    return found


def unplaced(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(m for m in graph if layer_of(m, layers) is None)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed path through a component, to name the arrows that make the cycle."""
    members = set(component)
    start = component[0]
    # breadth-first from start's successors back to start, inside the component
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in members or child in previous:
                    continue
                previous[child] = node
                if child == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(previous[path[-1]])
                    return list(reversed(path))
                following.append(child)
        frontier = following
    return component


def report(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every problem in the graph, worded for a reader."""
    problems = [
        f"{PACKAGE}.{m} is in no layer of tests/test_layering.LAYERS"
        for m in unplaced(graph, layers)
    ]
    for module, low, target, high in upward_imports(graph, layers):
        problems.append(
            f"{PACKAGE}.{module} (layer {low}) imports {PACKAGE}.{target} (layer {high}, higher)"
        )
    for component in cycles(graph):
        path = " -> ".join(f"{PACKAGE}.{m}" for m in cycle_path(graph, component))
        problems.append(f"import cycle: {path}")
    return problems


def test_layers_point_down_and_nothing_cycles():
    problems = report(import_graph())
    assert not problems, "\n".join(problems)


def test_only_the_command_line_touches_argparse():
    users = sorted(
        str(p.relative_to(ROOT.parent))
        for p in ROOT.rglob("*.py")
        if re.search(r"^\s*(import argparse|from argparse import)", p.read_text(), re.M)
    )
    assert users == ["ster_dist/cli.py"], users


def test_the_checker_reports_what_it_should():
    layers = [(("base",), "bottom"), (("mid",), "middle"), (("top", "peer"), "top")]
    graph = {
        "base": {"mid"},  # upward
        "mid": set(),
        "top": {"peer", "mid"},
        "peer": {"top"},  # a cycle within one layer
        "stray": set(),  # placed nowhere
    }
    problems = report(graph, layers)
    assert "ster_dist.base (layer 0) imports ster_dist.mid (layer 1, higher)" in problems
    assert "import cycle: ster_dist.peer -> ster_dist.top -> ster_dist.peer" in problems
    assert "ster_dist.stray is in no layer of tests/test_layering.LAYERS" in problems
    assert len(problems) == 3


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ster_dist import top\n")
    (pkg / "top.py").write_text(
        "import ster_dist.sub.leaf as x\nfrom ster_dist.sub.leaf import f\n"
    )
    (pkg / "caller.py").write_text('TARGET = "ster_dist.top:run"\n')
    graph = import_graph(pkg)
    assert graph == {
        "": set(),
        "caller": {"top"},
        "sub": {"sub.leaf"},
        "sub.leaf": {"top"},
        "top": {"sub.leaf"},
    }
    assert cycles(graph) == [["sub.leaf", "top"]]


def test_the_architecture_drawing_is_this_table():
    """docs/architecture.md draws the layers top to bottom, one row per layer: its module prefixes,
    then two or more spaces and what the layer holds. The drawing and LAYERS may not drift apart."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers: arrows point down", 1)[1]
    block = section.split("```", 2)[1]
    drawn = [
        tuple(re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split())
        for line in block.splitlines()
        if line.strip()
    ]
    table = [tuple(p for p in prefixes if p) for prefixes, _ in reversed(LAYERS)]
    assert drawn == table
