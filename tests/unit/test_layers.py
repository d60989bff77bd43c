"""The package's layers, read from the source files' imports: the client never imports the
kernels or the server, the kernels know nothing of gRPC, the server or the client, the
server never imports the client, and no package's modules import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The folder each subpackage of `expertd` is mapped from (pyproject.toml's package-dir).
PACKAGES = {"client": "expertd.client", "kernels": "expertd.kernels", "server": "expertd.server"}
PACKAGES["expertd"] = "expertd"


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    stem = path.stem
    return PACKAGES[folder] if stem == "__init__" else f"{PACKAGES[folder]}.{stem}"


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (lazy imports and
    importlib.import_module("name") included), absolute."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).glob("*.py"))


def forbidden(folder: str, prefixes: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(folder)
        for name in sorted(imports(path))
        if any(name == p or name.startswith(p + ".") for p in prefixes)
    ]


def test_every_package_has_sources():
    for folder in PACKAGES:
        assert sources(folder), folder


def test_the_client_imports_neither_kernels_nor_server():
    assert forbidden("client", ("expertd.kernels", "expertd.server")) == []


def test_the_kernels_know_nothing_of_grpc_the_server_or_the_client():
    banned = ("grpc", "grpc_health", "grpc_reflection", "expertd.v1")
    assert forbidden("kernels", (*banned, "expertd.server", "expertd.client")) == []


def test_the_server_never_imports_the_client():
    assert forbidden("server", ("expertd.client",)) == []


def test_what_the_layers_check_finds_an_import():
    """The checks above would see a violation (lazy imports inside functions included)."""
    found = imports(ROOT / "kernels" / "lookup.py")
    assert "expertd.kernels.backend" in found
    assert "expertd.kernels.cuda" in found  # importlib.import_module, on first lookup
    assert "expertd.kernels.build" in imports(ROOT / "kernels" / "cuda.py")  # a lazy import


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph `edges` (module -> modules it imports), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str]:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n, [*path, n])):
                return found
        state[m] = 2
        return []

    for m in sorted(edges):
        if m not in state and (found := visit(m, [m])):
            return found
    return []


def test_find_cycle_sees_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_no_import_cycle_inside_a_package(folder):
    """Within one package, the modules' imports (lazy ones included) form no cycle. A
    package's __init__ re-exports its modules: importing the package itself is no edge."""
    mods = {module_name(p): p for p in sources(folder)}
    edges = {
        m: {n for n in imports(p) if n in mods and n not in (m, PACKAGES[folder])}
        for m, p in mods.items()
    }
    assert find_cycle(edges) == []
