"""Every link from the README and docs/ to a file of this repository reaches it, and every
`#anchor` names a heading of its page (as GitHub makes anchors of headings), so a reader who
follows a link lands where the text says."""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, without link targets and punctuation,
    spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


@cache  # a page is parsed once, however many links name it
def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_is_githubs():
    assert slug("Latency under load: request-rate sweep (2026-12-02, AMD EPYC, AVX-512)") == \
        "latency-under-load-request-rate-sweep-2026-12-02-amd-epyc-avx-512"
    assert slug("Speculative decoding (`worker/engine/speculation.py`, `worker/engine/drafter.py`)") == \
        "speculative-decoding-workerenginespeculationpy-workerenginedrafterpy"
    assert slug("Where the time goes at 8–16 running requests") == "where-the-time-goes-at-816-running-requests"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_reaches_its_file_and_heading(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


@pytest.mark.parametrize("page", ["benchmarks.md", "benchmarks-record.md"])
def test_the_benchmark_pages_name_no_local_path(page):
    """A figure's command names paths of the repository, never of the machine it ran on."""
    text = (ROOT / "docs" / page).read_text()
    assert not re.findall(r"(?:^|[\s`(])(?:/tmp/|/home/|/work/|/root/|/opt/|~/)\S*", text)
