"""Two builds of streamq measured in turns on this machine: a commit before a change and this tree.

    .venv/bin/python benchmarks/ab.py --before 33b25f6 --rounds 3 -- \\
        benchmarks/deterministic.py --modes off --rounds 1 --weights as-served

The commit is checked out in a temporary git worktree; the benchmark script named after `--` is
this tree's in both (copied into the worktree), so only the engine differs. Each round runs it
in both checkouts, the order alternating, each run its own process on this venv's packages with
the checkout's code first on the path (the kernels of each are built once for it). The script
prints a JSON report with "rows" (benchmarks/deterministic.py's); per row (its --key) and per
round the ratio after / before of --metric, then the median of those ratios and their range, with
both builds' medians and the machine's facts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import print_table


def report_of(output: str) -> dict:
    """The first JSON object the script printed."""
    start = output.index("{")
    return json.JSONDecoder().raw_decode(output[start:])[0]


def run(checkout: Path, script: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    where = subprocess.run([sys.executable, "-c", "import worker; print(worker.__file__)"], cwd=checkout, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(checkout)):
        raise SystemExit(f"{checkout}: imports streamq from {where}, not from the checkout")
    done = subprocess.run([sys.executable, *script], cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(script)} failed in {checkout}:\n{done.stderr[-3000:]}")
    return report_of(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare this tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--key", default="workload", help="the field that names a row")
    parser.add_argument("--metric", default="off_tok_per_s", help="the field compared, higher is better")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: run in both checkouts")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise SystemExit("name the benchmark script after --")
    with tempfile.TemporaryDirectory(prefix="streamq-ab-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for path in (ROOT / "benchmarks").glob("*.py"):  # this tree's benchmark code in both
                shutil.copy(path, before / "benchmarks" / path.name)
            builds = {"before": before, "after": ROOT}
            results: dict[str, list[dict]] = {"before": [], "after": []}
            for r in range(args.rounds):
                for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    results[name].append(run(builds[name], script))
                    rows = {row[args.key]: row[args.metric] for row in results[name][-1]["rows"]}
                    print(f"# round {r + 1}, {name}: {rows}", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    table = []
    for row in results["after"][0]["rows"]:
        key = row[args.key]

        def values(name: str, key=key) -> list[float]:
            return [next(x[args.metric] for x in rep["rows"] if x[args.key] == key) for rep in results[name]]
        b, a = values("before"), values("after")
        ratios = [y / x for x, y in zip(b, a)]
        table.append({args.key: key, "before": round(statistics.median(b), 1), "after": round(statistics.median(a), 1),
                      "after_vs_before": round(statistics.median(ratios), 3),
                      "range": f"{min(ratios):.3f}-{max(ratios):.3f}",
                      "rounds_before": " / ".join(f"{x:.1f}" for x in b),
                      "rounds_after": " / ".join(f"{x:.1f}" for x in a)})
    machine = results["after"][0].get("machine", {})
    print(json.dumps({"before": args.before, "script": script, "machine": machine, "rows": table}, indent=1))
    print_table(list(table[0]), [list(row.values()) for row in table])
    print(f"\nbefore: {args.before}; after: this tree; script: {' '.join(script)}; machine: "
          f"{machine.get('cpu')}, flags {' '.join(machine.get('cpu_flags', []))}, {machine.get('dtype')}, "
          f"{machine.get('threads')} threads")


if __name__ == "__main__":
    main()
