"""The tree reads as the docs say: shared/ is what api/, worker/ and scheduler/ have in
common and imports none of them (nor the streamq command), the benchmarks import nothing from
the test suite, and every module is in the layout of docs/layout.md, as is every file of
benchmarks/, scripts/ and docs/, and no file the layout names is missing; a request goes through
the api's modules one way."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["api", "worker", "scheduler", "shared", "streamq"]


def _imports(path: Path) -> set[str]:
    """The top-level packages a file imports."""
    return {name.split(".")[0] for name in _dotted_imports(path)}


def _dotted_imports(path: Path) -> set[str]:
    """The modules a file imports, by their dotted names (absolute imports only)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
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
    named = set(re.findall(r"[a-z0-9_]+", layout))
    for package in PACKAGES:
        modules = [p for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"]
        missing = sorted(str(p.relative_to(ROOT)) for p in modules if p.stem not in named)
        assert not missing, f"docs/layout.md's layout does not name {missing}"


def test_a_messages_request_goes_through_the_api_one_way():
    """benchmarks/request_walk.py follows a Messages request through the real route, chat,
    generation and parser code: it comes back at most 3 times to an api module it had left."""
    from benchmarks.request_walk import returns, walk

    entries = walk()
    assert entries[0] == "api.anthropic.messages" and "api.core.generation" in entries, entries
    assert returns(entries) <= 3, " -> ".join(entries)


API_PROTOCOLS = ["openai", "anthropic", "native", "admin"]


def test_api_core_imports_no_protocol_and_no_protocol_imports_another():
    """api/core/ is what every protocol shares; each protocol package imports the core and its
    own modules only (api/app.py puts them together)."""
    wrong = []
    for path in sorted((ROOT / "api").rglob("*.py")):
        parts = path.relative_to(ROOT / "api").parts
        if len(parts) < 2:
            continue  # app.py, main.py: the assembly
        own = parts[0]
        for name in _dotted_imports(path):
            package = name.split(".")[1] if name.startswith("api.") and name.count(".") >= 1 else None
            if package in API_PROTOCOLS and package != own:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, wrong


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


def _layout_entries() -> dict[str, str]:
    """docs/layout.md's layout, by folder: each top folder's entry ("benchmarks": its text) and each
    indented sub-folder's ("worker/model")."""
    text = (ROOT / "docs" / "layout.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    entries: dict[str, str] = {}
    top = folder = None
    for line in block.splitlines():
        if match := re.match(r"([a-z_]+)/\s", line):
            top = folder = match.group(1)
        elif (match := re.match(r"  ([a-z_]+)/\s", line)) and top:
            folder = f"{top}/{match.group(1)}"
        if folder:
            entries[folder] = entries.get(folder, "") + line + "\n"
    return entries


# Folders whose files no entry names: what git ignores (benchmarks/gpu/wheels: fetched by gpu_check.sh).
UNLISTED = {ROOT / "benchmarks" / "gpu" / "wheels"}


def _files(folder: str) -> list[Path]:
    """The files of a folder at any depth, less compiled Python and the unlisted folders."""
    return sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and not UNLISTED & set(p.parents))


@pytest.mark.parametrize("folder", ["benchmarks", "scripts", "docs"])
def test_the_layout_names_every_file_of_benchmarks_scripts_and_docs(folder):
    """Each file by its name in its folder's entry (a file in a sub-folder by its name or its path
    from the folder)."""
    entries = _layout_entries()
    assert folder in entries, f"docs/layout.md's layout has no {folder}/ entry"
    entry = entries[folder]
    names = set(re.findall(r"[\w./-]+", entry))
    missing = [str(p.relative_to(ROOT)) for p in _files(folder)
               if p.name not in names and str(p.relative_to(ROOT / folder)) not in names]
    assert not missing, f"docs/layout.md's {folder}/ entry does not name {missing}"


# Words of the layout that look like a file's name and are not one.
NOT_FILES = {"llama.cpp"}  # the project whose server the peer benchmarks run
FILE_NAME = re.compile(r"[\w./-]*\w\.(?:py|md|sh|json|txt|jinja|xz|cpp|j2|yml|yaml|png|svg|lua|toml|conf|html|js|css)\b")


def test_the_layout_names_no_file_that_does_not_exist():
    """Every file name in a folder's entry is a file of that folder (at any depth), or a path from
    the repository's root."""
    absent = []
    for folder, entry in _layout_entries().items():
        paths = [str(p.relative_to(ROOT / folder)) for p in _files(folder)]
        for name in sorted(set(FILE_NAME.findall(entry)) - NOT_FILES):
            if not (ROOT / name).exists() and not any(p == name or p.endswith("/" + name) for p in paths):
                absent.append(f"{folder}/: {name}")
    assert not absent, f"docs/layout.md names files that do not exist: {absent}"
