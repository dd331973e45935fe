"""The engine's C++ CPU kernels (`csrc/*.cpp`): built on first use, cached, loaded as
`torch.ops.rose.*`.

They are built (about 20 s, once) for this CPU and PyTorch with the machine's C++ compiler and
PyTorch's headers, -march=native, and cached under a hash of the sources, flags, compiler,
PyTorch and CPU. The build takes no lock: each process that finds no build compiles to a file
of its own and renames it into place, so a build killed half-way leaves nothing that a later
one waits for (PyTorch's JIT builder leaves a lock file).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp")))
# -march=native: built for this CPU. -ffast-math lets GCC vectorise exp; it is given to the
# compile step only, since linked in it would set the whole process's FPU to flush denormals.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
BUILD_TIMEOUT_S = 300


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def cache_dir() -> Path:
    """`ROSE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/rose/kernels` (~/.cache by default)."""
    if os.environ.get("ROSE_KERNEL_CACHE"):
        return Path(os.environ["ROSE_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rose" / "kernels"


def _cpu_features() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() + platform.machine()


def _build(cxx: str, target: Path) -> None:
    """Compile each source, then link (without -ffast-math), into a file of this process's,
    then rename it to `target` (atomic: a concurrent build of the same file only does the work
    twice)."""
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        lib = Path(tmp) / target.name
        commands = [[cxx, *COMPILE_FLAGS, abi, *includes, "-c", str(source), "-o", obj]
                    for source, obj in zip(SOURCES, objects, strict=True)]
        commands.append([cxx, "-shared", *objects, *libraries, "-lc10", "-ltorch_cpu", "-o", str(lib)])
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"building the engine's CPU kernels failed ({command[0]}):\n"
                                   f"{done.stderr[-3000:]}\nattention_backend='sdpa' needs no build")
        os.replace(lib, target)


@functools.cache
def load() -> Path:
    """Build the kernels (or find their build) and load them into this process: once, before
    the first iteration, so that no request waits for a compile. Returns the library's path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the engine's CPU kernels need a C++ compiler (c++, or $CXX): none found; "
                           "attention_backend='sdpa' needs none")
    key = "\n".join([*(source.read_text() for source in SOURCES), " ".join(COMPILE_FLAGS), cxx,
                     torch.__version__, str(Path(torch.__file__).parent), _cpu_features()])
    target = cache_dir() / f"rose_cpu-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not target.exists():
        _build(cxx, target)
    torch.ops.load_library(str(target))
    return target


def ready() -> bool:
    """Whether `load` has run in this process: the `torch.ops.rose` ops exist."""
    return load.cache_info().currsize > 0
