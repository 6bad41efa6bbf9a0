"""The project's modules and their imports, read statically with `ast` (no module of ours is imported):
the checker behind tests/test_structure.py.

The modules are the one import package `localllm`, named as they import: localllm/** as localllm.x,
kernels/*.py as localllm.kernels.x, quantize/*.py as localllm.quantize.x, commands/*.py as
localllm.commands.x, cli.py as localllm.cli (localllm/__init__.py, hatch_build.py).

Every import statement counts, at any depth: one inside a function (a lazy import) or under
`if TYPE_CHECKING:` still couples two modules. What an import couples to (an Edge):
- `import a.b.c` -> module a.b.c.
- `from P import n` -> module P.n when P.n is a module of ours (a submodule), else module P itself (n is
  a name P's code defines or re-exports, so P's code must have run first).
- Importing a submodule never adds an edge to the packages above it. Python initialises those first,
  and a package `__init__` importing its own submodules is the ordinary layout, not a cycle.
So `from . import x` (x a sibling module) couples to x alone, while `from . import name` (a name the
package's `__init__` defines or re-exports) couples to that `__init__`: with the `__init__` importing the
submodule, that is a cycle, and import_cycles reports it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Where each part of the package lives in a checkout: (module prefix, folder or file).
PARTS = (
    ("localllm", ROOT / "localllm"),
    ("localllm.kernels", ROOT / "kernels"),
    ("localllm.quantize", ROOT / "quantize"),
    ("localllm.commands", ROOT / "commands"),
    ("localllm.cli", ROOT / "cli.py"),
)


@dataclass(frozen=True)
class Module:
    name: str  # dotted, as imported
    path: Path
    package: bool  # an __init__.py
    shown: str  # path in messages (relative to the checkout)


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the module it couples to
    name: str | None  # the name imported from target (None: the module itself)
    line: int


def discover(parts: tuple[tuple[str, Path], ...], root: Path) -> dict[str, Module]:
    """Every .py file under parts, by dotted module name."""
    modules: dict[str, Module] = {}
    for prefix, place in parts:
        files = [(place, [])] if place.suffix == ".py" else [
            (p, list(p.relative_to(place).with_suffix("").parts)) for p in sorted(place.rglob("*.py"))]
        for path, names in files:
            package = bool(names) and names[-1] == "__init__"
            name = ".".join([prefix, *(names[:-1] if package else names)])
            assert name not in modules, f"{path} and {modules[name].path} are both {name}"
            modules[name] = Module(name, path, package, str(path.relative_to(root)))
    return modules


@lru_cache(maxsize=1)
def project_modules() -> dict[str, Module]:
    return discover(PARTS, ROOT)


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


def all_edges(modules: dict[str, Module]) -> list[Edge]:
    return [e for m in modules.values() for e in module_edges(m, modules)]


def unknown_imports(module: Module, modules: dict[str, Module], top: str = "localllm") -> list[str]:
    """Imports naming a module under `top` that does not exist (a stale lazy import fails only when run)."""
    found = []
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [absolute(module, node.level, node.module)]  # its names may be values, not modules
        else:
            continue
        for name in names:
            if (name == top or name.startswith(top + ".")) and name not in modules:
                found.append(f"{module.shown}:{node.lineno}: {name}")
    return found


def in_any(name: str, prefixes: tuple[str, ...]) -> bool:
    """name is one of the modules prefixes name, or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# ---- cycles


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


def import_cycles(modules: dict[str, Module], edges: list[Edge]) -> list[str]:
    """One line per set of modules that import each other: a shortest cycle through its first module,
    each step with the file and line of its import, then the whole set."""
    first: dict[tuple[str, str], Edge] = {}
    for edge in edges:
        first.setdefault((edge.source, edge.target), edge)
    succ: dict[str, list[str]] = {}
    for a, b in first:
        succ.setdefault(a, []).append(b)
    cycles = []
    for component in strongly_connected(sorted(modules), succ):
        if len(component) == 1 and (component[0], component[0]) not in first:
            continue
        path = cycle_through(component[0], set(component), first)
        steps = " -> ".join(f"{e.source} ({modules[e.source].shown}:{e.line})" for e in path)
        cycles.append(f"{steps} -> {path[0].source}  [all of: {', '.join(component)}]")
    return cycles


# ---- private names


def private(name: str) -> bool:
    """_x, not __dunder__."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_aliases(module: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local names this file binds to project modules (import a.b as m, from P import sub, import a.b)."""
    aliases = {}
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
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
    edges = [e for e in module_edges(module, modules) if e.target != module.name]
    found = [f"{module.shown}:{e.line}: {e.name} from {e.target}" for e in edges
             if e.name is not None and private(e.name)]
    found += [f"{module.shown}:{e.line}: private module {e.target}" for e in edges
              if any(private(p) for p in e.target.split("."))]
    aliases = module_aliases(module, modules)
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = (dotted(node.value) or "").split(".")
            if base[0] not in aliases:
                continue
            target = ".".join([aliases[base[0]], *base[1:]])
            if target in modules and target != module.name:
                found.append(f"{module.shown}:{node.lineno}: {node.attr} from {target} (attribute)")
    return found


# ---- device branches

DEVICE_NAMES = ("cpu", "cuda", "mps")  # a string naming one of these, optionally with ":index"
DEVICE_FLAGS = ("is_cuda", "is_mps", "is_cpu")  # tensor attributes


def device_string(node: ast.AST) -> bool:
    """"cuda", "cpu:0", ("cuda", "mps"), torch.device("cuda")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] in DEVICE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(device_string(e) for e in node.elts)
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
        value = node.value
        if node.attr == "type" and (
                (isinstance(value, ast.Attribute) and value.attr.endswith("device"))
                or (isinstance(value, ast.Name) and value.id.lower().endswith(("device", "dev")))
                or (isinstance(value, ast.Call) and (dotted(value.func) or "").split(".")[-1] == "device")):
            return "device.type"
        if node.attr == "is_available" and (dotted(value) or "").split(".")[-1] in ("cuda", "mps"):
            return f"{dotted(value)}.is_available"
    if isinstance(node, ast.Compare) and any(device_string(x) for x in [node.left, *node.comparators]):
        return "comparison with a device name"
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
            and node.args and device_string(node.args[0])):
        return "startswith a device name"
    return None


def device_branches(module: Module) -> list[str]:
    """One line per source line holding a device branch: path:line: pattern: code."""
    source = module.path.read_text(encoding="utf-8").splitlines()
    lines: dict[int, str] = {}
    for node in ast.walk(parse(module.path)):
        pattern = device_branch(node)
        if pattern and node.lineno not in lines:
            lines[node.lineno] = pattern
    return [f"{module.shown}:{n}: {p}: {source[n - 1].strip()}" for n, p in sorted(lines.items())]
