"""The tree reads as the docs say: shared/ is what api/, worker/ and scheduler/ have in
common and imports none of them (nor the streamq command), the benchmarks import nothing from
the test suite, and every module is in the layout of docs/layout.md."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["api", "worker", "scheduler", "shared", "streamq"]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_shared_imports_none_of_the_services_nor_the_command():
    for path in sorted((ROOT / "shared").glob("*.py")):
        assert not _imports(path) & {"api", "worker", "scheduler", "streamq"}, path.name


def test_no_benchmark_imports_the_tests():
    """What both need (tiny models, the stack, ...) lives in streamq/ (streamq/testing/, streamq/stack.py)."""
    importing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "benchmarks").rglob("*.py")) if "tests" in _imports(p)]
    assert not importing, f"these benchmarks import from tests/: {importing}"


def test_the_layout_names_every_module():
    text = (ROOT / "docs" / "layout.md").read_text()
    layout = text[text.index("## Layout"):]
    end = layout.find("\n## ")
    layout = layout if end == -1 else layout[:end]
    assert "```" in layout, "docs/layout.md's \"## Layout\" has no code block"
    named = set(re.findall(r"[a-z_]+", layout))
    for package in PACKAGES:
        modules = [p for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"]
        missing = sorted(str(p.relative_to(ROOT)) for p in modules if p.stem not in named)
        assert not missing, f"docs/layout.md's layout does not name {missing}"


# worker/'s packages and what each may import of worker/ (its __init__ says the same).
WORKER_PACKAGES = {
    "model": {"model"},
    "engine": {"model", "engine"},
    "backends": {"model", "engine", "backends"},
    "service": {"model", "engine", "service"},
}


def _worker_module(name: str) -> str | None:
    """The worker module a dotted name is or is in (worker.model.batch.Chunk -> worker.model.batch)."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        path = ROOT.joinpath(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:end])
    return None


def _worker_edges(path: Path) -> set[str]:
    """The worker modules a file imports anywhere in it (in functions and TYPE_CHECKING blocks too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    found = {_worker_module(n) for n in names if n.startswith("worker.")}
    return {m for m in found if m and m.count(".") >= 2 or m == "worker.main"} - {None}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_worker_is_four_packages_and_main():
    top = {p.name for p in (ROOT / "worker").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert top == {"__init__.py", "main.py"} | set(WORKER_PACKAGES)


def test_each_worker_package_imports_only_those_it_may():
    for package, allowed in WORKER_PACKAGES.items():
        for path in sorted((ROOT / "worker" / package).glob("*.py")):
            for module in _worker_edges(path):
                assert module.split(".")[1] in allowed, f"{_module(path)} imports {module}"


def test_the_forwards_import_only_the_model_package_and_never_the_runner():
    """worker/model/forwards/ is part of worker/model/; model_runner.py imports it, never the reverse."""
    for path in sorted((ROOT / "worker" / "model" / "forwards").glob("*.py")):
        for module in _worker_edges(path):
            assert module.split(".")[1] == "model" and module != "worker.model.model_runner", \
                f"{_module(path)} imports {module}"


def test_no_import_circle_in_worker():
    graph = {_module(p): _worker_edges(p) for p in (ROOT / "worker").rglob("*.py") if p.name != "__init__.py"}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
