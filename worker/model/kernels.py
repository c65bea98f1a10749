"""The CPU step kernels (worker/model/csrc/step_kernels.cpp), compiled once per machine and cached.

The first worker on a machine compiles them for its CPU (about half a minute on 2 cores); later
starts load the cached build in well under a second. The build lands in
`STREAMQ_KERNEL_CACHE_DIR` (default `~/.cache/streamq/kernels`), named by a hash of the source,
the torch version, the compiler flags and the CPU's flags, so a changed source or another CPU
builds anew. When the build fails (no compiler, no ninja) the worker logs why and runs the
eager path: slower, never broken. `STREAMQ_CPU_KERNELS=false` turns them off.

The projection kernels (panel_linear, quant_linear, quant_linear_int8) run on any ISA the build
holds and the CPU runs (the module's `isas`, widest first: avx512vnni, whose quantized projections
round activations to int8, then avx512 and avx2); `STREAMQ_CPU_ISA` holds them to one, or to none
("portable": oneDNN for float weights, dequantize-then-matmul in Python for quantized ones).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from shared.settings import StepSettings, WorkerSettings

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "step_kernels.cpp", CSRC / "paged_attention.cpp", CSRC / "panel_linear.cpp", CSRC / "quant_linear.cpp",
           CSRC / "quant_linear_int8.cpp"]
ISAS = ("auto", "avx512vnni", "avx512", "avx2", "portable")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17"]


def cpu_has(flag: str) -> bool:
    """Whether this CPU reports `flag` (as /proc/cpuinfo names it: amx_bf16, avx512_bf16...)."""
    return flag in _cpu_flags().split()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """One folder per sources, torch, flags, CPU and environment. The environment (sys.prefix):
    torch rebuilds a folder whose include paths changed, so two checkouts' venvs sharing the
    cache rebuilt each other's kernels (a minute each) every time the other had loaded them."""
    texts = [path.read_text() for path in sorted(CSRC.glob("*.[ch]*"))]  # the headers too
    key = "\n".join([*texts, torch.__version__, " ".join(FLAGS), platform.machine(), _cpu_flags(), sys.prefix])
    return f"streamq_step_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load(settings: WorkerSettings | StepSettings | None = None) -> ModuleType | IsaKernels | None:
    """The compiled kernels, built in the settings' kernel cache, their projections on the
    settings' cpu_isa; None (logged) where they cannot be built."""
    settings = settings or WorkerSettings()
    module = load_from(settings.kernel_cache_dir)
    if module is None:
        if settings.cpu_isa not in ("auto", "portable"):
            raise ValueError(f"cpu_isa={settings.cpu_isa} asked for, but the CPU step kernels did not build "
                             "(see the log); this worker runs only the portable path")
        return None
    return with_isa(module, settings.cpu_isa)


class IsaKernels:
    """The step kernels with their projections held to one ISA: every other kernel is the
    module's; `isa` is what Weight hands the projection kernels, and `panel_dtypes` what
    panel_linear computes on it (none where portable)."""

    def __init__(self, module: ModuleType, isa: str):
        self.module, self.isa = module, isa
        self.panel_dtypes = () if isa == "portable" else tuple(module.panel_dtypes_of(isa))

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def with_isa(module: ModuleType, isa: str) -> ModuleType | IsaKernels:
    """`module` as is for "auto", else held to `isa`; a ValueError naming it and this CPU's
    ISAs where this CPU (or the build) lacks it."""
    if isa not in ISAS:
        raise ValueError(f"cpu_isa={isa!r}: one of {', '.join(ISAS)}")
    if isa == "auto":
        return module
    if isa != "portable" and isa not in module.isas:
        raise ValueError(f"cpu_isa={isa} asked for, but this CPU ({cpu_model()}) runs the projection kernels only on: "
                         f"{', '.join([*module.isas, 'portable'])}")
    return IsaKernels(module, isa)


def widest_fp32(module: ModuleType | None) -> str:
    """The widest ISA of the kernels `module` whose quantized projections keep fp32 activations
    (all but avx512vnni); "portable" where it runs none."""
    return next((isa for isa in (module.isas if module is not None else []) if isa != "avx512vnni"), "portable")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def load_from(folder: Path) -> ModuleType | None:
    from torch.utils import cpp_extension

    name = build_name()
    directory = folder / name
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _builder(directory):
            module = cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=FLAGS,
                                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja, a failed build: the eager path still serves
        log.warning("CPU step kernels unavailable, the eager path serves (slower): %s",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None
    log.info("CPU step kernels loaded", extra={"build": str(directory)})
    return module


@contextmanager
def _builder(directory: Path) -> Iterator[None]:
    """This process alone builds or loads the kernels in `directory` (others wait), under a lock
    the OS releases when its holder dies. torch's own lock is a file (`lock`) that a worker
    killed while compiling leaves behind, and the next worker then waited on it forever; holding
    this lock, no other build is running, so such a file is stale and goes."""
    with open(directory / "streamq.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            if (directory / "lock").exists():
                log.warning("removing a stale build lock (a worker was stopped while compiling)")
                (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
