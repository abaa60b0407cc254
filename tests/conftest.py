"""Builders shared by the tests: tiny random HF checkpoints (saved with `transformers`) and
a small byte-level BPE tokenizer trained on the spot."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from pagedllm import LLM
    from pagedllm.serving.tritonserver import TritonServer

# No GPU here: `@triton.jit` kernels run in the Triton interpreter on CPU tensors. Triton reads
# this when it is first imported (transformers imports it too), so it is set before anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a city far away, there lived a curious engineer.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests at every step of the engine.",
    "Bonjour, ça va? Très bien, merci. Grüße aus Köln! 東京は晴れです。 😀🚀",
] * 20

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)

ARCHS: dict[str, dict[str, Any]] = {
    # GQA 2:1, untied, llama3 rope scaling
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        tie_word_embeddings=False,
    ),
    # q/k/v bias, tied embeddings, no GQA
    "qwen2": dict(num_key_value_heads=4, tie_word_embeddings=True),
    # sliding window shorter than the longest test sequences, GQA 4:1
    "mistral": dict(num_key_value_heads=1, sliding_window=24, tie_word_embeddings=False),
}


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY["vocab_size"] - 16,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))


def make_checkpoint(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random `arch` checkpoint (fp32 safetensors + tokenizer) to `path`."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    config = cls[0](**{**TINY, **ARCHS[arch], **overrides})
    model = cls[1](config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def hf_model(path: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_greedy(
    model: Any, prompts: list[list[int]], max_new_tokens: int, eos: int | None
) -> list[list[int]]:
    """The oracle: HF greedy generate, one prompt at a time (no padding effects)."""
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=1,
            )
        outs.append(ids[0, len(p) :].tolist())
    return outs


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def slow_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama slow enough for long generations (seconds per thousand tokens)."""
    return make_checkpoint(
        tmp_path_factory.mktemp("slow") / "llama",
        "llama",
        max_position_embeddings=4096,
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=512,
    )


def serving(path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A real tritonserver over the checkpoint at `path` (float32), for a fixture to yield from."""
    from pagedllm.serving.launcher import make_server

    with make_server(str(path), dtype="float32", work_dir=tmp_path_factory.mktemp("triton")) as s:
        yield s


@pytest.fixture(scope="session")
def shared_server(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """One server for every module that sets `SHARES_SERVER = True`: modules that only send it
    requests and read its metrics as deltas (a start costs ~27 s of CPU; idle, it costs none)."""
    yield from serving(checkpoints["llama"], tmp_path_factory)


@pytest.fixture(scope="session")
def slow_shared_server(
    slow_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """One server over `slow_checkpoint`, for the modules whose requests must outlive a cancel
    or stop seen at the next poll (0.2 s, a probe 0.5 s) on any machine, under any load: its 4k
    context holds thousands of tokens, seconds of work (the tiny one's 480 take ~0.5 s). Its
    modules send it requests and read its metrics as deltas, like `shared_server`'s."""
    yield from serving(slow_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest,
    checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TritonServer]:
    """A real tritonserver with the tiny llama checkpoint (float32): one per test module, or
    the session's shared one where the module sets `SHARES_SERVER = True`."""
    if getattr(request.module, "SHARES_SERVER", False):
        yield request.getfixturevalue("shared_server")
    else:
        yield from serving(checkpoints["llama"], tmp_path_factory)


@pytest.fixture(scope="session")
def openai_model_dir(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny llama checkpoint with a chat template (a copy: the shared one stays as is), for
    the gateway modules (test_openai and those that alias its fixtures)."""
    from openai_gateway import MODEL, with_chat_template

    path = tmp_path_factory.mktemp("openai") / MODEL
    shutil.copytree(checkpoints["llama"], path)
    return with_chat_template(path)


@pytest.fixture(scope="session")
def openai_server(
    openai_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """One server for the gateway modules: they send it requests and read its metrics as
    deltas, like the modules on `shared_server`."""
    yield from serving(openai_model_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def openai_gateway(
    openai_server: TritonServer, openai_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`pagedllm openai` in front of `openai_server`; its base URL (http://127.0.0.1:PORT)."""
    from openai_gateway import warm_gateway

    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with warm_gateway(openai_server, openai_model_dir, log) as url:
        yield url


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path]) -> LLM:
    """The offline API on the same checkpoint: the servers' oracle."""
    from pagedllm import LLM

    return LLM(str(checkpoints["llama"]), dtype="float32")


# The LoRA server, started once a session for test_lora_server.py and test_lora_gateway.py;
# imported last: its helpers import this module's.
from lora_server_fixtures import adapters, lora_llm, lora_server, offline  # noqa: E402, F401
