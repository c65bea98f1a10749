"""The package as the deploy image installs it (a wheel, outside the source tree) holds every file
the CPU step kernels need, and compiles them from there: a worker in a container runs the kernels,
not the slow eager path. It holds the Lua scripts that shared/scripts.py reads as package data too."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shared import scripts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this checkout's files, unpacked into a folder of its own (as site-packages).
    Built from a copy of the files git keeps (tracked, or new and not ignored): a build/ folder left
    in the checkout by an earlier build would put its stale files in the wheel, and hide a missing one."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():  # a tracked file deleted in the work tree is not part of it
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("streamq-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def test_the_wheel_holds_every_kernel_source_and_each_file_they_include(installed):
    csrc = installed / "worker" / "model" / "csrc"
    sources = re.findall(r'CSRC / "([^"]+)"', (ROOT / "worker" / "model" / "kernels.py").read_text())
    assert sources and all((csrc / name).is_file() for name in sources), sorted(p.name for p in csrc.iterdir())
    seen, todo = set(), list(sources)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        included = re.findall(r'^#include "([^"]+)"', (csrc / name).read_text(), re.MULTILINE)
        missing = [inc for inc in included if not (csrc / inc).is_file()]
        assert not missing, f"{name} includes {missing}, which the wheel lacks"
        todo += included
    assert {p.name for p in (ROOT / "worker" / "model" / "csrc").iterdir()} <= {p.name for p in csrc.iterdir()}


def test_the_installed_package_compiles_its_kernels_outside_the_source_tree(installed, tmp_path):
    """In a process that imports the unpacked package (not the checkout), from another folder."""
    script = ("import sys; from worker.model import kernels; "
              "assert kernels.CSRC.is_relative_to(sys.argv[1]), kernels.CSRC; "
              "module = kernels.load_from(__import__('pathlib').Path(sys.argv[2])); "
              "assert module is not None, 'the kernels did not build'; print(module.isas)")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run([sys.executable, "-c", script, str(installed), str(tmp_path / "kernels")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_wheel_holds_every_lua_script_and_the_installed_package_loads_them(installed, tmp_path):
    """shared/scripts.py reads shared/lua/ as package data: every file there is in the wheel."""
    written = {p.name for p in (ROOT / "shared" / "lua").glob("*.lua")}
    assert written and written <= {p.name for p in (installed / "shared" / "lua").glob("*.lua")}
    script = ("import sys; from shared import scripts; "
              "assert scripts.__file__.startswith(sys.argv[1]), scripts.__file__; "
              "print(len([scripts.source(n) for n in scripts.names() if not scripts.is_library(n)]))")
    done = subprocess.run([sys.executable, "-c", script, str(installed)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(installed)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout) == len([n for n in scripts.names() if not scripts.is_library(n)])
