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
