"""fxtrain's packages import downwards only, and no two files import each other, even indirectly.

A cycle is what lets a change in the profiler break the capture, or the runtime depend on a pass:
the layer map below (documented at the top of docs/architecture.md) says who may import whom.
Every import counts: at module level, inside functions, under ``if TYPE_CHECKING:``, relative or
absolute; ``from . import x`` names the submodule ``x``; importing ``a.b.c`` also runs the
``__init__`` of the packages ``a`` and ``a.b`` when they are not the importer's own.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fxtrain"

pytestmark = pytest.mark.cpu_only(reason="source scan (the imports of fxtrain/): no tensors")

# Lowest first. A unit (a subpackage, or a top-level module of fxtrain/) may import units of its
# own layer or below; "fxtrain" is the package's __init__: the public names, on top of everything.
LAYERS: Sequence[Tuple[str, ...]] = (
    ("errors", "version", "extras", "torch_private", "options", "graph_walk", "report", "models", "capture_state",
     "corpus", "signature", "state_dicts"),
    ("pythonop",),
    ("runtime",),          # with the contract types: the captured step, plans, reports, guards
    ("passes",),
    ("cost",),             # FLOPs per op, the fake-step tracker: what the budget and the profiler cost with
    ("capture",),          # dynamo backend, AOTAutograd split, the memory budget planner
    ("cache",),
    ("module", "module_with_loss"),
    ("profile", "pipeline", "fuzz", "bench"),
    ("cli",),
    ("fxtrain",),
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}

Sources = Dict[str, Tuple[str, str, bool]]   # module name -> (path shown, source text, is a package)
Edge = Tuple[str, str, str, int]             # importer, imported, path shown, line


def read_sources(root: Path = ROOT) -> Sources:
    out: Sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if package else parts)
        out[name] = (str(path.relative_to(root.parent)), path.read_text(), package)
    return out


def _targets(node: ast.AST, importer: str, package: bool, modules: Sources) -> List[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = importer.split(".") if package else importer.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # ``from a import b``: the submodule a.b where there is one, else a name defined by a.
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]


def import_edges(modules: Sources) -> List[Edge]:
    edges: List[Edge] = []
    for importer, (path, text, package) in modules.items():
        own = importer if package else importer.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(text, path)):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, importer, package, modules):
                parts = target.split(".")
                # The packages above the target run first, unless the importer is inside them
                # (the target itself counts even then: its __init__ is what is read).
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    inside = own == name or own.startswith(name + ".")
                    if name in modules and name != importer and (i == len(parts) or not inside):
                        edges.append((importer, name, path, node.lineno))
    return edges


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(edges: Sequence[Edge]) -> List[str]:
    deepest: Dict[Tuple[str, int, str], Tuple[str, str]] = {}   # one message per import statement
    for a, b, path, line in edges:
        if unit(a) in LAYER and unit(b) in LAYER and LAYER[unit(b)] > LAYER[unit(a)]:
            key = (path, line, unit(b))
            if key not in deepest or len(b) > len(deepest[key][1]):
                deepest[key] = (a, b)
    return sorted(f"{path}:{line} imports {b}: {unit(b)!r} (layer {LAYER[unit(b)]}) is above {unit(a)!r} "
                  f"(layer {LAYER[unit(a)]})" for (path, line, _), (a, b) in deepest.items())


def cycles(graph: Dict[str, Dict[str, str]]) -> List[List[str]]:
    """Strongly connected components of more than one node (Tarjan), each as a closed walk."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_walk(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _walk(graph: Dict[str, Dict[str, str]], component: set) -> List[str]:
    """One cycle through the component, to name in a message."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in component)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return path + [start]
        fresh = [w for w in nxt if w not in seen]
        if not fresh:   # no simple path forward: fall back to the whole component
            return sorted(component)
        path.append(fresh[0])
        seen.add(fresh[0])


def cycle_messages(edges: Sequence[Edge], of=lambda m: m) -> List[str]:
    graph: Dict[str, Dict[str, str]] = {}
    for a, b, path, line in edges:
        if of(a) != of(b):
            graph.setdefault(of(a), {}).setdefault(of(b), f"{path}:{line}")
    out = []
    for cyc in cycles(graph):
        steps = [f"{x} -> {y} ({graph[x][y]})" for x, y in zip(cyc, cyc[1:]) if y in graph.get(x, {})]
        out.append("import cycle: " + "; ".join(steps or cyc))
    return out


def check(modules: Sources) -> List[str]:
    edges = import_edges(modules)
    unplaced = sorted({f"{path}: {unit(m)!r} is in no layer of tests/test_layers.py: LAYERS"
                       for m, (path, _, _) in modules.items() if unit(m) not in LAYER})
    return unplaced + layer_violations(edges) + cycle_messages(edges, unit) + cycle_messages(edges)


# ------------------------------------------------------------------------------------------ tests
def test_every_import_goes_down_the_layers_and_no_files_import_in_a_cycle():
    problems = check(read_sources())
    assert not problems, "\n".join(problems)


def test_the_check_finds_an_upward_import_inside_a_function():
    modules = read_sources()
    modules["fxtrain.runtime.synthetic"] = ("fxtrain/runtime/synthetic.py",
                                            "def f():\n    from ..passes import run_passes\n", False)
    problems = check(modules)
    assert any(p.startswith("fxtrain/runtime/synthetic.py:2 imports fxtrain.passes:") for p in problems), problems


def test_the_check_finds_an_import_of_the_top_level_package_and_a_type_only_import():
    modules = read_sources()
    modules["fxtrain.cache.synthetic"] = (
        "fxtrain/cache/synthetic.py",
        "from typing import TYPE_CHECKING\nfrom .. import __version__\nif TYPE_CHECKING:\n"
        "    from ..module import TrainModule\n", False)
    problems = check(modules)
    assert any(p.startswith("fxtrain/cache/synthetic.py:2 imports fxtrain:") for p in problems), problems
    assert any(p.startswith("fxtrain/cache/synthetic.py:4 imports fxtrain.module:") for p in problems), problems


def test_the_check_finds_a_cycle_between_two_files_of_one_package():
    modules = read_sources()
    modules["fxtrain.passes.one"] = ("fxtrain/passes/one.py", "from . import two\n", False)
    modules["fxtrain.passes.two"] = ("fxtrain/passes/two.py", "def f():\n    import fxtrain.passes.one\n", False)
    problems = check(modules)
    assert any("fxtrain.passes.one -> fxtrain.passes.two (fxtrain/passes/one.py:1)" in p
               and "fxtrain.passes.two -> fxtrain.passes.one (fxtrain/passes/two.py:2)" in p for p in problems), problems


def test_the_check_finds_a_cycle_through_a_package_init():
    # Importing fxtrain.profile.inputs runs profile/__init__.py first, whatever inputs.py imports.
    modules = read_sources()
    path, text, package = modules["fxtrain.profile"]
    modules["fxtrain.profile"] = (path, text + "from ..pipeline.synthetic import f\n", package)
    modules["fxtrain.pipeline.synthetic"] = ("fxtrain/pipeline/synthetic.py",
                                             "from ..profile.inputs import fake_inputs\n", False)
    problems = check(modules)
    assert any("fxtrain.pipeline.synthetic -> fxtrain.profile (fxtrain/pipeline/synthetic.py:1)" in p
               for p in problems), problems


def test_a_new_package_must_be_placed_in_a_layer():
    modules = read_sources()
    modules["fxtrain.ground"] = ("fxtrain/ground.py", "", False)
    assert check(modules) == ["fxtrain/ground.py: 'ground' is in no layer of tests/test_layers.py: LAYERS"]
