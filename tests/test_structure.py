"""The project's module structure, checked statically (tests/module_structure.py reads every module with
`ast`, imports none, and counts every import, lazy ones too; its docstring says what an import couples):
- no import cycles among the project's modules;
- the library (everything but localllm.commands and localllm.cli) never imports the command layer;
- quantize/ imports nothing else of ours;
- no private name (_x, not dunder) taken from another project module;
- device branches (module_structure.device_branch lists the patterns) only in the backends
  (localllm.backends), the kernels (localllm.kernels) and device selection (localllm.device);
- every import of a localllm.* module names one that exists.
The last tests check the checker on small sources.
"""

from __future__ import annotations

import ast

import pytest

from module_structure import (Edge, Module, absolute, all_edges, cycle_through, device_branch, device_branches,
                              discover, import_cycles, in_any, private_uses, project_modules, strongly_connected,
                              unknown_imports)

COMMANDS = ("localllm.commands", "localllm.cli", "localllm.__main__")  # the layer above the library (__main__: `python -m localllm`)
QUANTIZE = ("localllm.quantize",)  # the bottom layer: block formats and the GGUF writer
DEVICE_MODULES = ("localllm.backends", "localllm.kernels", "localllm.device")  # where device branches belong


def test_no_import_cycles():
    modules = project_modules()
    cycles = import_cycles(modules, all_edges(modules))
    assert not cycles, "import cycles among the project's modules:\n" + "\n".join(cycles)


def test_library_never_imports_commands():
    modules = project_modules()
    bad = [f"{modules[e.source].shown}:{e.line}: {e.source} imports {e.target}" for e in all_edges(modules)
           if not in_any(e.source, COMMANDS) and in_any(e.target, COMMANDS)]
    assert not bad, "library modules import the command layer:\n" + "\n".join(bad)


def test_quantize_imports_only_itself():
    """quantize/ (block formats, presets, plans, the writer) imports nothing else of ours: data flows one
    way, from it to the loaders and kernels (quantize/formats.py)."""
    modules = project_modules()
    bad = [f"{modules[e.source].shown}:{e.line}: {e.source} imports {e.target}" for e in all_edges(modules)
           if in_any(e.source, QUANTIZE) and not in_any(e.target, QUANTIZE)]
    assert not bad, "quantize/ imports other project modules:\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    modules = project_modules()
    bad = [p for m in modules.values() for p in private_uses(m, modules)]
    assert not bad, "private names (_x) used outside the module that defines them:\n" + "\n".join(bad)


def test_device_branches_only_in_backends():
    bad = [b for m in project_modules().values() if not in_any(m.name, DEVICE_MODULES) for b in device_branches(m)]
    assert not bad, (f"{len(bad)} device branches outside {', '.join(DEVICE_MODULES)} "
                     "(a backend decides these once, at load):\n" + "\n".join(bad))


def test_imports_name_existing_modules():
    modules = project_modules()
    bad = [u for m in modules.values() for u in unknown_imports(m, modules)]
    assert not bad, "imports of project modules that do not exist:\n" + "\n".join(bad)


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
    assert pattern in {device_branch(n) for n in ast.walk(ast.parse(code))}


@pytest.mark.parametrize("code", ["x.device", "torch.device('cuda')", "name == 'cpu_decode'", "dtype.type",
                                  "t.to(device)", "{'cpu': 1}", "x.startswith('cu')"])
def test_device_patterns_not_found(code):
    assert {device_branch(n) for n in ast.walk(ast.parse(code))} == {None}


def test_cycle_finder_reports_the_path():
    succ = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert [c for c in strongly_connected(["a", "b", "c", "d"], succ) if len(c) > 1] == [["a", "b", "c"]]
    first = {(a, b): Edge(a, b, None, 1) for a, bs in succ.items() for b in bs}
    assert [e.source for e in cycle_through("a", {"a", "b", "c"}, first)] == ["a", "b", "c"]


def test_relative_imports_resolve_as_in_the_wheel():
    modules = project_modules()
    assert {"localllm", "localllm.cli", "localllm.kernels.triton_base", "localllm.quantize",
            "localllm.commands.bench", "localllm.tokenizer.bpe", "localllm.device"} <= set(modules)
    kernel, package = modules["localllm.kernels.linear"], modules["localllm.tokenizer"]
    assert absolute(kernel, 1, "qweight") == "localllm.kernels.qweight"
    assert absolute(kernel, 2, "device") == "localllm.device"
    assert absolute(package, 1, "bpe") == "localllm.tokenizer.bpe"
    assert absolute(package, 2, None) == "localllm"


def write(root, files: dict[str, str]) -> dict[str, Module]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return discover((("pkg", root / "pkg"),), root)


def test_package_init_and_sibling_imports(tmp_path):
    """`from . import sibling` couples to the sibling alone (no cycle with an __init__ importing it);
    `from . import name` couples to the __init__ (a cycle when the __init__ imports the importer);
    lazy imports count."""
    modules = write(tmp_path, {
        "pkg/__init__.py": "from .a import f\nVALUE = 1\n",
        "pkg/a.py": "from . import b\ndef f():\n    from .c import g\n",
        "pkg/b.py": "X = 1\n",
        "pkg/c.py": "from pkg import VALUE\nfrom . import a\n",
    })
    edges = {(e.source, e.target, e.name) for e in all_edges(modules)}
    assert edges == {("pkg", "pkg.a", "f"), ("pkg.a", "pkg.b", None), ("pkg.a", "pkg.c", "g"),
                     ("pkg.c", "pkg", "VALUE"), ("pkg.c", "pkg.a", None)}
    cycles = import_cycles(modules, all_edges(modules))
    assert len(cycles) == 1 and "[all of: pkg, pkg.a, pkg.c]" in cycles[0] and "pkg/a.py:3" in cycles[0]


def test_private_names_found(tmp_path):
    modules = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "_x = 1\n__version__ = 1\n",
        "pkg/_hidden.py": "",
        "pkg/b.py": "from .a import _x, __version__\nfrom . import a as m, _hidden\nm._y\nimport pkg.a\npkg.a._z\n",
    })
    found = private_uses(modules["pkg.b"], modules)
    assert [f.split(": ", 1)[1] for f in found] == [
        "_x from pkg.a", "private module pkg._hidden", "_y from pkg.a (attribute)", "_z from pkg.a (attribute)"]


def test_unknown_imports_found(tmp_path):
    modules = write(tmp_path, {"pkg/__init__.py": "",
                               "pkg/a.py": "import pkg.gone\nfrom .b import x\nfrom . import a\n"})
    assert [u.split(": ")[1] for u in unknown_imports(modules["pkg.a"], modules, top="pkg")] == ["pkg.gone", "pkg.b"]
