"""Imports run one way: every module of the package (and patches/) imports only modules of its own
layer or of layers before it, in the order the README's repository layout states (its line
"Imports run one way: A < B < ..."), and no modules import each other in a circle at module level.
Every module belongs to a layer; the package holds no tests or tools."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = "megatron_hetero"


def _layers() -> list[list[str]]:
    """The README's order: layers separated by '<', a layer's members by ','."""
    match = re.search(r"^Imports run one way: (.+?)\.?$", (ROOT / "README.md").read_text(), re.M)
    assert match, "the README's repository layout states the import order"
    return [[name.strip().strip("`") for name in layer.split(",")] for layer in match.group(1).split("<")]


def _modules() -> dict[str, Path]:
    """Module name -> file, patches/ as megatron_hetero.patches (where setup.py installs it)."""
    found = {}
    for base, prefix in ((ROOT / PACKAGE, PACKAGE), (ROOT / "patches", f"{PACKAGE}.patches")):
        for path in base.rglob("*.py"):
            parts = [prefix, *path.relative_to(base).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict) -> list[tuple[str, bool]]:
    """(module imported, at module level) of every megatron_hetero import in the file: `from pkg
    import mod` imports pkg.mod, `from mod import name` mod."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out += [(name, id(node) in top) for name in names if name.startswith(PACKAGE)]
    return out


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """The layer of the longest name in the order that is `module` or a package holding it."""
    rel = module.removeprefix(PACKAGE).lstrip(".")
    if not rel:  # the package's own __init__: a docstring
        return 0
    best = max(((len(name), n) for n, layer in enumerate(layers) for name in layer
                if rel == name or rel.startswith(name + ".")), default=None)
    assert best is not None, f"{module} is in no layer of the README's import order; place it there"
    return best[1]


def _resolve(name: str, modules: dict) -> str | None:
    """The module an import names (`from pkg import mod` names pkg.mod; `from mod import func`, mod)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph():
    modules, layers = _modules(), _layers()
    edges = []
    for module, path in modules.items():
        for name, top in _imports(path, modules):
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.append((module, target, top))
    return modules, layers, edges


def test_every_module_has_a_layer_and_no_import_runs_upward():
    modules, layers, edges = _graph()
    for module in modules:
        _layer_of(module, layers)
    upward = sorted({f"{source} -> {target}" for source, target, _ in edges
                     if _layer_of(target, layers) > _layer_of(source, layers)
                     and not target.startswith(source + ".")})  # a package's __init__ imports its own
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_module_level_circle():
    modules, _, edges = _graph()
    graph = {m: sorted({t for s, t, top in edges if s == m and top}) for m in modules}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                pytest.fail("module-level import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node)


def test_package_holds_no_tests_or_tools():
    """The repository's tests/ and tools/ are not subpackages of the installed package."""
    import importlib.util

    assert importlib.util.find_spec(f"{PACKAGE}.tests") is None
    assert importlib.util.find_spec(f"{PACKAGE}.tools") is None
