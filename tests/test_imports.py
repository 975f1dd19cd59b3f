"""Imports run one way: each folder of the package is one layer, and a module imports
only modules of its own folder or of folders before it, in the order the README's repository layout
states (its line "Imports run one way: A < B < ..."): module-level and function-level imports alike,
and modules named by string for importlib ("megatron_hetero.x.y" or "megatron_hetero.x.y:attr").
No modules import each other in a circle at module level. Every module belongs to a layer; the
package holds no tests or tools."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = "megatron_hetero"


NAMED = re.compile(r"megatron_hetero(\.\w+)+(:\w+)?")  # a module named for importlib


def _layers() -> list[list[str]]:
    """The README's order: layers separated by '<', a layer's members by ','."""
    match = re.search(r"^Imports run one way: (.+?)\.?$", (ROOT / "README.md").read_text(), re.M)
    assert match, "the README's repository layout states the import order"
    return [[name.strip().strip("`").rstrip("/") for name in layer.split(",")] for layer in match.group(1).split("<")]


def _modules() -> dict[str, Path]:
    """Module name -> file."""
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = [PACKAGE, *path.relative_to(ROOT / PACKAGE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict) -> list[tuple[str, bool]]:
    """(module imported, at module level) of every megatron_hetero import in the file: `from pkg
    import mod` imports pkg.mod, `from mod import name` mod; a module named by string, as imported
    inside a function."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED.fullmatch(node.value):
            out.append((node.value.partition(":")[0], False))
            continue
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
    """The layer of the folder holding `module` (or of the package's own module, an entry point)."""
    rel = module.removeprefix(PACKAGE).lstrip(".")
    if not rel:  # the package's own __init__: a docstring
        return 0
    folder = rel.split(".")[0]
    found = [n for n, layer in enumerate(layers) if folder in layer]
    assert found, f"{module}: its folder {folder} is in no layer of the README's import order; place it there"
    return found[0]


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
                     if _layer_of(target, layers) > _layer_of(source, layers)})
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_each_layer_is_a_folder_named_once():
    """The order names the package's folders and its own entry-point modules, each once: a folder is
    one layer, never split over two."""
    names = [name for layer in _layers() for name in layer]
    assert len(names) == len(set(names)), f"named twice in the import order: {names}"
    for name in names:
        place = ROOT / PACKAGE / name
        assert place.is_dir() or place.with_suffix(".py").is_file(), f"{name}: no such folder or module"
    folders = {p.name for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(names), f"folders the import order does not place: {sorted(folders - set(names))}"


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
