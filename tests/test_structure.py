"""The project's module structure, read statically with `ast` (no module of ours is imported): no import
cycles, library below commands, no private names across modules, device branches only in backends.

The modules are the one import package `localllm`, named as they import: localllm/** as localllm.x,
kernels/*.py as localllm.kernels.x, quantize/*.py as localllm.quantize.x, commands/*.py as
localllm.commands.x, cli.py as localllm.cli (localllm/__init__.py, hatch_build.py).

Every import statement counts, at any depth: one inside a function (a lazy import) or under
`if TYPE_CHECKING:` still couples two modules. What an import couples to:
- `import a.b.c` -> module a.b.c.
- `from P import n` -> module P.n when P.n is a module of ours (a submodule), else module P itself (n is
  a name P's code defines or re-exports, so P's code must have run first).
- Importing a submodule never adds an edge to the packages above it. Python initialises those first,
  and a package `__init__` importing its own submodules is the ordinary layout, not a cycle.
So `from . import x` (x a sibling module) couples to x alone, while `from . import name` (a name the
package's `__init__` defines or re-exports) couples to that `__init__`: with the `__init__` importing the
submodule, that is a cycle, and test_no_import_cycles reports it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Where each part of the package lives in a checkout: (module prefix, folder or file).
PARTS = (
    ("localllm", ROOT / "localllm"),
    ("localllm.kernels", ROOT / "kernels"),
    ("localllm.quantize", ROOT / "quantize"),
    ("localllm.commands", ROOT / "commands"),
    ("localllm.cli", ROOT / "cli.py"),
)
COMMANDS = ("localllm.commands", "localllm.cli")  # the layer above the library

# Where device branches belong: the backends, the kernels, and device selection.
DEVICE_MODULES = ("localllm.backends", "localllm.kernels", "localllm.device")
DEVICE_NAMES = ("cpu", "cuda", "mps")  # a string naming one of these, optionally with ":index"
DEVICE_FLAGS = ("is_cuda", "is_mps", "is_cpu")  # tensor attributes


@dataclass(frozen=True)
class Module:
    name: str  # dotted, as imported
    path: Path
    package: bool  # an __init__.py


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the module it couples to
    name: str | None  # the name imported from target (None: the module itself)
    line: int

    def where(self, modules: dict[str, Module]) -> str:
        return f"{modules[self.source].path.relative_to(ROOT)}:{self.line}"


@lru_cache(maxsize=1)
def project_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for prefix, place in PARTS:
        if place.suffix == ".py":
            modules[prefix] = Module(prefix, place, False)
            continue
        for path in sorted(place.rglob("*.py")):
            parts = list(path.relative_to(place).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            name = ".".join([prefix, *parts])
            assert name not in modules, f"{path} and {modules[name].path} are both {name}"
            modules[name] = Module(name, path, package)
    return modules


@lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def absolute(module: Module, level: int, name: str | None) -> str:
    """The absolute module a `from` import names (level: its leading dots)."""
    if level == 0:
        return name or ""
    package = module.name if module.package else module.name.rpartition(".")[0]
    base = package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def module_edges(module: Module, modules: dict[str, Module]) -> list[Edge]:
    """Every import of a project module in this file, at any depth (see the module docstring)."""
    edges = []
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    edges.append(Edge(module.name, alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node.level, node.module)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    edges.append(Edge(module.name, sub, None, node.lineno))
                elif source in modules:
                    edges.append(Edge(module.name, source, alias.name, node.lineno))
    return edges


def unknown_imports(module: Module, modules: dict[str, Module]) -> list[str]:
    """Imports naming a localllm.* module that does not exist (a stale lazy import fails only when run)."""
    found = []
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node.level, node.module)
            names = [source if source in modules or f"{source}.{a.name}" in modules else source
                     for a in node.names]
        else:
            continue
        for name in names:
            if (name == "localllm" or name.startswith("localllm.")) and name not in modules:
                found.append(f"{module.path.relative_to(ROOT)}:{node.lineno}: {name}")
    return found


@lru_cache(maxsize=1)
def import_graph() -> tuple[Edge, ...]:
    modules = project_modules()
    return tuple(e for m in modules.values() for e in module_edges(m, modules))


def strongly_connected(nodes: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(succ.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(succ.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                components.append(sorted(component))
    return components


def cycle_through(start: str, members: set[str], first: dict[tuple[str, str], Edge]) -> list[Edge]:
    """A shortest import cycle from start back to start inside one strongly connected component."""
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for (a, b), edge in first.items():
                if a != node or b not in members:
                    continue
                if b == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if b not in came:
                    came[b] = edge
                    nxt.append(b)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycles():
    modules = project_modules()
    first: dict[tuple[str, str], Edge] = {}
    for edge in import_graph():
        first.setdefault((edge.source, edge.target), edge)
    succ: dict[str, list[str]] = {}
    for a, b in first:
        succ.setdefault(a, []).append(b)
    cycles = []
    for component in strongly_connected(sorted(modules), succ):
        if len(component) == 1 and (component[0], component[0]) not in first:
            continue
        path = cycle_through(component[0], set(component), first)
        steps = " -> ".join(f"{e.source} ({e.where(modules)})" for e in path)
        cycles.append(f"{steps} -> {path[0].source}  [component: {', '.join(component)}]")
    assert not cycles, "import cycles among the project's modules:\n" + "\n".join(cycles)


def test_library_never_imports_commands():
    modules = project_modules()
    bad = [f"{e.where(modules)}: {e.source} imports {e.target}" for e in import_graph()
           if not in_any(e.source, COMMANDS) and in_any(e.target, COMMANDS)]
    assert not bad, "library modules import the command layer:\n" + "\n".join(bad)


def test_imports_name_existing_modules():
    modules = project_modules()
    bad = [u for m in modules.values() for u in unknown_imports(m, modules)]
    assert not bad, "imports of project modules that do not exist:\n" + "\n".join(bad)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_aliases(module: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local names this file binds to project modules (import a.b as m, from P import sub, import a.b)."""
    aliases = {}
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node.level, node.module)
            for a in node.names:
                if f"{source}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
    return {k: v for k, v in aliases.items() if v in modules}


def dotted(node: ast.AST) -> str | None:
    """a.b.c for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_uses(module: Module, modules: dict[str, Module]) -> list[str]:
    """Private names this module takes from another project module: imported by name, a private
    module imported, or read as an attribute of an imported module (m._x)."""
    where = module.path.relative_to(ROOT)
    found = [f"{where}:{e.line}: {e.name} from {e.target}" for e in module_edges(module, modules)
             if e.target != module.name and e.name is not None and private(e.name)]
    found += [f"{where}:{e.line}: private module {e.target}" for e in module_edges(module, modules)
              if e.target != module.name and any(private(p) for p in e.target.split("."))]
    aliases = module_aliases(module, modules)
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = dotted(node.value)
            if base is None or base.split(".")[0] not in aliases:
                continue
            target = ".".join([aliases[base.split(".")[0]], *base.split(".")[1:]])
            if target in modules and target != module.name:
                found.append(f"{where}:{node.lineno}: {node.attr} from {target} (attribute)")
    return found


def test_no_private_names_across_modules():
    modules = project_modules()
    bad = [p for m in modules.values() for p in private_uses(m, modules)]
    assert not bad, "private names (_x) used outside the module that defines them:\n" + "\n".join(bad)


def device_string(node: ast.AST) -> bool:
    """"cuda", "cpu:0", ("cuda", "mps"), torch.device("cuda")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] in DEVICE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and any(device_string(e) for e in node.elts)
    if isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] == "device":
        return bool(node.args) and device_string(node.args[0])
    return False


def device_branch(node: ast.AST) -> str | None:
    """Which device-branch pattern a node is, if any. The patterns:
    - a tensor's device flag: `x.is_cuda`, `x.is_mps`, `x.is_cpu`;
    - a device's type: `<...>.device.type`, `device.type` / `dev.type` (a name ending in device or dev),
      `torch.device(...).type`;
    - backend availability: `torch.cuda.is_available`, `torch.backends.mps.is_available` (any
      `...cuda.is_available` / `...mps.is_available`);
    - a comparison (==, !=, in, not in, is, is not) with a device name: `device == "cuda"`,
      `d in ("cuda", "mps")`, `t.device != torch.device("cpu")`;
    - `s.startswith("cuda")` (any device name).
    Each is a branch wherever it appears, in an `if` or not (`graphs = x.is_cuda` decides as much)."""
    if isinstance(node, ast.Attribute):
        if node.attr in DEVICE_FLAGS:
            return node.attr
        if node.attr == "type":
            value = node.value
            if isinstance(value, ast.Attribute) and value.attr.endswith("device"):
                return "device.type"
            if isinstance(value, ast.Name) and value.id.lower().endswith(("device", "dev")):
                return "device.type"
            if isinstance(value, ast.Call) and (dotted(value.func) or "").split(".")[-1] == "device":
                return "device.type"
        if node.attr == "is_available" and (dotted(node.value) or "").split(".")[-1] in ("cuda", "mps"):
            return f"{dotted(node.value)}.is_available"
    if isinstance(node, ast.Compare) and any(device_string(x) for x in [node.left, *node.comparators]):
        return "comparison with a device name"
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
            and node.args and device_string(node.args[0])):
        return "startswith a device name"
    return None


def device_branches(module: Module) -> list[str]:
    """One line per source line holding a device branch: path:line: pattern: code."""
    tree = parse(module.path)
    source = module.path.read_text(encoding="utf-8").splitlines()
    lines: dict[int, str] = {}
    for node in ast.walk(tree):
        pattern = device_branch(node)
        if pattern and node.lineno not in lines:
            lines[node.lineno] = pattern
    where = module.path.relative_to(ROOT)
    return [f"{where}:{n}: {p}: {source[n - 1].strip()}" for n, p in sorted(lines.items())]


def in_any(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_device_branches_only_in_backends():
    bad = [b for m in project_modules().values() if not in_any(m.name, DEVICE_MODULES)
           for b in device_branches(m)]
    assert not bad, (f"{len(bad)} device branches outside {', '.join(DEVICE_MODULES)} "
                     "(a backend decides these once, at load):\n" + "\n".join(bad))


# ---- the checker itself, on small sources (it must find what it claims to find)


@pytest.mark.parametrize("code, pattern", [
    ("x.is_cuda", "is_cuda"),
    ("if w.device.type == 'cuda': pass", "device.type"),
    ("device.type", "device.type"),
    ("torch.device(d).type", "device.type"),
    ("torch.cuda.is_available()", "torch.cuda.is_available"),
    ("torch.backends.mps.is_available()", "torch.backends.mps.is_available"),
    ("device == 'cpu'", "comparison with a device name"),
    ("d not in ('cuda:0', 'mps')", "comparison with a device name"),
    ("t.device != torch.device('cpu')", "comparison with a device name"),
    ("str(d).startswith('cuda')", "startswith a device name"),
])
def test_device_patterns_found(code, pattern):
    found = {device_branch(n) for n in ast.walk(ast.parse(code))}
    assert pattern in found


@pytest.mark.parametrize("code", ["x.device", "torch.device('cuda')", "name == 'cpu_decode'",
                                  "dtype.type", "t.to(device)", "{'cpu': 1}"])
def test_device_patterns_not_found(code):
    assert {device_branch(n) for n in ast.walk(ast.parse(code))} == {None}


def test_cycle_finder_reports_the_path():
    succ = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    components = [c for c in strongly_connected(["a", "b", "c", "d"], succ) if len(c) > 1]
    assert components == [["a", "b", "c"]]
    first = {(a, b): Edge(a, b, None, 1) for a, bs in succ.items() for b in bs}
    assert [e.source for e in cycle_through("a", {"a", "b", "c"}, first)] == ["a", "b", "c"]


def test_relative_imports_resolve_as_in_the_wheel():
    kernel = Module("localllm.kernels.linear", ROOT / "kernels" / "linear.py", False)
    package = Module("localllm.tokenizer", ROOT / "localllm" / "tokenizer" / "__init__.py", True)
    assert absolute(kernel, 1, "qweight") == "localllm.kernels.qweight"
    assert absolute(kernel, 2, "device") == "localllm.device"
    assert absolute(package, 1, "bpe") == "localllm.tokenizer.bpe"
    assert absolute(package, 2, None) == "localllm"
    assert {"localllm.cli", "localllm.kernels.triton_base", "localllm.quantize", "localllm.commands.bench",
            "localllm.tokenizer.bpe", "localllm.device"} <= set(project_modules())
