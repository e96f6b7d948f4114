"""The import structure (docs/architecture.md): one-way packages, no circle between modules or between rooms.

Every `import` statement of every module of `model_patches` and `hf_dllm_spec` counts, including the ones
deferred into functions: a circle that works only because one side imports late is still a circle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("model_patches", "hf_dllm_spec")


def module_files() -> dict[str, pathlib.Path]:
    """Every module of the two packages: dotted name -> file (folders without `__init__.py` hold data, not code:
    `hf_dllm_spec/hub/custom_generate/` is copied into exported checkpoints)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not all((parent / "__init__.py").is_file() for parent in path.relative_to(ROOT).parents
                       if parent != pathlib.Path(".")):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (top level or inside functions)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:      # `import a.b.c` of a module path: its deepest module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of the directed graph `edges` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}                              # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def room(module: str) -> str:
    """A module's room: its subpackage (`hf_dllm_spec.maths`), or the module itself at a package's top level."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_families_never_import_the_library():
    offenders = {name: sorted(t for t in targets if t.startswith("hf_dllm_spec"))
                 for name, targets in graph().items() if name.startswith("model_patches")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_circle_between_modules():
    edges = graph()
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_no_circle_between_rooms():
    """Rooms (subpackages and top-level modules) import one way; a package's `__init__` is its public face and
    may import from any of its rooms, so it is left out."""
    edges: dict[str, set[str]] = {}
    for name, targets in graph().items():
        if name in PACKAGES:
            continue
        for target in targets:
            if target not in PACKAGES and room(target) != room(name):
                edges.setdefault(room(name), set()).add(room(target))
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_only_the_command_line_imports_the_tools():
    """The tools (jobs, cost model, serving benchmark) are a floor above the library and the server: the decoding
    path and the server never depend on them; only `hf_dllm_spec.cli` and the tools themselves import them."""
    def is_tool(module: str) -> bool:
        return module == "hf_dllm_spec.tools" or module.startswith("hf_dllm_spec.tools.")

    offenders = {name: sorted(t for t in targets if is_tool(t)) for name, targets in graph().items()
                 if not is_tool(name) and name != "hf_dllm_spec.cli"}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_tools_are_found_by_the_walk():
    """The rule above reads real edges: the command line does import the tools."""
    assert any(t.startswith("hf_dllm_spec.tools") for t in graph()["hf_dllm_spec.cli"])


@pytest.mark.parametrize("edges,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
])
def test_find_cycle_finds_circles(edges, expected):
    assert find_cycle(edges) == expected


def test_deferred_imports_count(tmp_path):
    """An import inside a function is an edge: the circle the issue found hid behind such imports."""
    source = "def f():\n    from .b import x\n"
    path = tmp_path / "a.py"
    path.write_text(source)
    assert imports_of("pkg.a", path, {"pkg.a": path, "pkg.b": tmp_path / "b.py"}) == {"pkg.b"}


def test_family_classes_reach_the_library_through_the_entry_point():
    """The families' `generate` finds the library as an installed decoding backend, never by import."""
    import importlib.metadata

    from model_patches.generation import BACKEND_ENTRY_POINT_GROUP

    (entry,) = importlib.metadata.entry_points(group=BACKEND_ENTRY_POINT_GROUP)
    from hf_dllm_spec.integration.mixin import generate_with_strategy

    assert entry.load() is generate_with_strategy


def test_native_decoding_strategy_matches_the_family_patch():
    import model_patches

    for patch in model_patches.PATCHES:
        for _, model_class in patch.auto_classes:
            assert model_class.native_decoding_strategy == patch.native_strategy, model_class
