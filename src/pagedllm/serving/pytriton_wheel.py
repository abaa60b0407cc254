"""The ``tritonserver`` of a PyPI wheel and the Python backend directory it needs.

The PyPI wheel ``nvidia-pytriton==0.7.0`` ships ``tritonserver`` 2.51, the Python backend and
one backend stub per Python version. Install it without its dependencies (it pins
``numpy<2``; the server binary needs none of them)::

    pip install --no-deps nvidia-pytriton==0.7.0

Two facts shape the model side:

* The stub embeds ``libpython3.X`` in *isolated* mode: it ignores ``PYTHONPATH`` and sees
  neither this virtual environment nor ``src/``. The launcher lists the directories to add in
  ``PAGEDLLM_SYS_PATH`` (``os.pathsep``-separated) and every ``model.py`` starts with the lines
  below, *before* importing ``triton_python_backend_utils`` (which imports numpy)::

      import os, site, sys
      _before = list(sys.path)
      for _p in os.environ.get("PAGEDLLM_SYS_PATH", "").split(os.pathsep):
          if _p:
              site.addsitedir(_p)  # also runs *.pth files (editable installs)
      sys.path[:] = [p for p in sys.path if p not in _before] + _before

* The stub's pybind11 predates NumPy 2: with numpy 2 in the stub, tensors are silently
  garbled (zero strides). The first numpy on ``PAGEDLLM_SYS_PATH`` must be 1.x, e.g. a
  directory made by ``pip install --no-deps --target DIR "numpy<2"`` listed first
  (torch and the rest of pagedllm work with it). :func:`server_env` refuses numpy 2.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

SYS_PATH_ENV = "PAGEDLLM_SYS_PATH"
PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB = "triton_python_backend_stub"


def stub_model(cmdline: Sequence[str]) -> str | None:
    """The model a Python-backend stub process serves, from its command line (the stub, then
    the model's .../<model>/<version>/model.py); None for any other process."""
    if len(cmdline) > 1 and Path(cmdline[0]).name == _STUB and cmdline[1].endswith("model.py"):
        return Path(cmdline[1]).parents[1].name
    return None


def find_pytriton() -> Path:
    """Return the ``pytriton/tritonserver`` directory of the installed ``nvidia-pytriton`` wheel:
    ``bin/tritonserver``, ``backends/python`` and ``python_backend_stubs/<X.Y>/`` live there, the
    shared libraries in the sibling ``nvidia_pytriton.libs`` (see :func:`pytriton_libs`)."""
    spec = importlib.util.find_spec("pytriton")  # locate without importing (it wants numpy<2)
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        server = Path(root) / "tritonserver"
        if (server / "bin" / "tritonserver").is_file() and (server / "backends/python").is_dir():
            return server
    raise FileNotFoundError(
        f"no tritonserver binary found (searched {roots or 'nothing: pytriton is not installed'});"
        f" install it with `{sys.executable} -m pip install --no-deps {PYTRITON_REQUIREMENT}`"
    )


def pytriton_libs(server_dir: Path | None = None) -> Path:
    """The wheel's bundled shared libraries (``libtritonserver``, ``libcudart``, ...)."""
    libs = (server_dir or find_pytriton()).parent.parent / "nvidia_pytriton.libs"
    if not libs.is_dir():
        raise FileNotFoundError(f"{libs} is missing: reinstall {PYTRITON_REQUIREMENT}")
    return libs


def prepare_backend_dir(dest: Path, python_version: str = "3.11") -> Path:
    """Build (once) a ``--backend-directory``: ``dest/python/`` holds the Python backend and the
    stub for ``python_version``. Files are replaced atomically and only when their size or
    mtime differ, so repeated and concurrent calls are cheap and safe. Returns ``dest``."""
    server = find_pytriton()
    stub = server / "python_backend_stubs" / python_version / _STUB
    if not stub.is_file():
        have = sorted(p.name for p in (server / "python_backend_stubs").iterdir())
        raise FileNotFoundError(f"no backend stub for Python {python_version} (have {have})")
    target_dir = Path(dest) / "python"
    target_dir.mkdir(parents=True, exist_ok=True)
    for src in [server / "backends" / "python" / name for name in _BACKEND_FILES] + [stub]:
        target, st = target_dir / src.name, src.stat()
        with contextlib.suppress(FileNotFoundError):
            cur = target.stat()
            if (cur.st_size, cur.st_mtime_ns) == (st.st_size, st.st_mtime_ns):
                continue
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        shutil.copy2(src, tmp)  # keeps the mode (the stub is executable) and the mtime
        os.replace(tmp, target)
    return Path(dest)


def _numpy_version(directory: Path) -> str | None:
    """Version of the numpy package directly inside ``directory`` (``None`` if absent)."""
    if not (directory / "numpy" / "__init__.py").is_file():
        return None
    for info in directory.glob("numpy-*.dist-info"):
        return info.name[len("numpy-") : -len(".dist-info")]
    match = re.search(
        r"""^version\s*=\s*['"]([^'"]+)""", _read(directory / "numpy/version.py"), re.M
    )
    return match.group(1) if match else "unknown"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def server_env(extra_pythonpath: list[str]) -> dict[str, str]:
    """Environment for ``tritonserver`` (a copy of ``os.environ`` plus):

    * ``LD_LIBRARY_PATH``: the wheel's libraries (the copied stub and backend lose their
      ``$ORIGIN`` rpath; without them the stub cannot start and the server hangs), then this
      interpreter's ``libpython`` directory, so the stub embeds the very Python of this
      environment instead of the system's ``libpython3.X``;
    * :data:`SYS_PATH_ENV`: the directories each ``model.py`` prepends to ``sys.path``;
    * ``PAGEDLLM_PYTHON``: this interpreter, which worker processes run (the stub is no Python).

    Raises ``ValueError`` if the first numpy found along ``extra_pythonpath`` is 2.x.
    """
    for directory in extra_pythonpath:
        version = _numpy_version(Path(directory))
        if version is not None:
            if version.split(".")[0] != "1":
                raise ValueError(
                    f"the stub would import numpy {version} from {directory}; it needs numpy<2: "
                    f'`pip install --no-deps --target DIR "numpy<2"` and put DIR first'
                )
            break
    env = dict(os.environ)
    ld_path = [str(pytriton_libs())]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        ld_path.append(libdir)
    ld_path += [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(ld_path))
    env[SYS_PATH_ENV] = os.pathsep.join(str(p) for p in extra_pythonpath)
    env.setdefault("PAGEDLLM_PYTHON", sys.executable)
    return env
