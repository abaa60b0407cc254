"""The pooling runner (`LLM(runner="pooling").embed`) against HF transformers: the base model's
last hidden states (`AutoModel`, final norm included) pooled the same way, one prompt at a time
(no padding effects), for each pooling type, mixed lengths, tiny random Llama and Qwen3
checkpoints and the real SmolLM2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from families import make_family_checkpoint
from pagedllm import LLM, PoolerConfig, PoolingParams
from pagedllm.pooling.params import resolve_pooler

# 1-token prompts (a "decode" to the attention backend) next to prompts over several blocks
PROMPTS = [[5], *random_prompts(7, (2, 70), 384, seed=3)]


def hf_embeddings(model: Any, prompts: list[list[int]], pooling: str, normalize: bool) -> Any:
    """The oracle: the base model's last hidden state, pooled and optionally normalised."""
    out = []
    for p in prompts:
        with torch.no_grad():
            h = model(input_ids=torch.tensor([p])).last_hidden_state[0].float()
        v = {"LAST": h[-1], "CLS": h[0], "MEAN": h.mean(0)}[pooling]
        out.append(F.normalize(v, dim=-1) if normalize else v)
    return torch.stack(out)


def hf_base(path: Path) -> Any:
    import transformers

    return transformers.AutoModel.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def vectors(llm: LLM, prompts: Any, params: PoolingParams | None = None) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, params)])


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    cos = F.cosine_similarity(ours, ref, dim=-1)
    assert cos.min().item() >= 0.9999, cos
    torch.testing.assert_close(ours.norm(dim=-1), ref.norm(dim=-1), rtol=1e-3, atol=1e-4)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_checkpoint(tmp_path_factory.mktemp("qwen3") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def tiny(checkpoints: dict[str, Path], qwen3: Path) -> dict[str, Path]:
    return {"llama": checkpoints["llama"], "qwen3": qwen3}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_equal_to_transformers(tiny: dict[str, Path], arch: str, pooling: str) -> None:
    path = tiny[arch]
    hf = hf_base(path)
    for normalize in (True, False):
        config = PoolerConfig(pooling_type=pooling, normalize=normalize)
        llm = LLM(str(path), dtype="float32", runner="pooling", pooler_config=config)
        ours = vectors(llm, [{"prompt_token_ids": p} for p in PROMPTS])
        assert_close(ours, hf_embeddings(hf, PROMPTS, pooling, normalize))
        if normalize:
            torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(PROMPTS)))


def test_batches_split_by_token_budget(checkpoints: dict[str, Path]) -> None:
    """More prompts than a pass holds (by tokens and by sequences): the same vectors."""
    path = checkpoints["llama"]
    prompts = random_prompts(20, (1, 60), 384, seed=5)
    small = LLM(
        str(path),
        dtype="float32",
        runner="pooling",
        max_num_batched_tokens=64,
        max_num_seqs=3,
        max_model_len=64,
    )
    assert_close(
        vectors(small, [{"prompt_token_ids": p} for p in prompts]),
        hf_embeddings(hf_base(path), prompts, "LAST", True),
    )


def test_defaults_and_sentence_transformers(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = checkpoints["llama"]
    plain = resolve_pooler(path, None)
    assert (plain.pooling_type, plain.normalize) == ("LAST", True)
    st = tmp_path / "st"
    shutil.copytree(path, st)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (st / "modules.json").write_text(json.dumps(modules))
    (st / "1_Pooling").mkdir()
    mode = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    (st / "1_Pooling" / "config.json").write_text(json.dumps(mode))
    mean = resolve_pooler(st, None)
    assert (mean.pooling_type, mean.normalize) == ("MEAN", False)  # no Normalize module
    assert resolve_pooler(st, PoolerConfig(normalize=True)).normalize  # the caller's wins
    llm = LLM(str(st), dtype="float32", runner="pooling")
    assert_close(
        vectors(llm, ["The quick brown fox"]),
        hf_embeddings(
            hf_base(path), [llm.get_tokenizer().encode("The quick brown fox")], "MEAN", False
        ),
    )
    modules.append(
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        }
    )
    (st / "modules.json").write_text(json.dumps(modules))
    assert resolve_pooler(st, None).normalize
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        resolve_pooler(st, None)


def test_matryoshka_dimensions(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", runner="pooling")
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=16))
    assert len(vectors(llm, "hello", PoolingParams(dimensions=64))[0]) == 64  # its own size
    mat = tmp_path / "mat"
    shutil.copytree(path, mat)
    config = json.loads((mat / "config.json").read_text())
    (mat / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(mat), dtype="float32", runner="pooling")
    ids = [llm.get_tokenizer().encode("hello world")]
    full = hf_embeddings(hf_base(path), ids, "LAST", False)
    # truncated first, then normalised (vLLM's order)
    assert_close(
        vectors(llm, "hello world", PoolingParams(dimensions=16)), F.normalize(full[:, :16], dim=-1)
    )
    with pytest.raises(ValueError, match="allows"):
        llm.embed("hello", PoolingParams(dimensions=24))


def test_refusals_and_truncation(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["llama"]), dtype="float32", runner="pooling", max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        llm.embed({"prompt_token_ids": []})
    long = random_prompts(1, (40, 40), 384, seed=1)[0]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed({"prompt_token_ids": long})
    cut = vectors(llm, {"prompt_token_ids": long}, PoolingParams(truncate_prompt_tokens=10))
    assert torch.equal(cut, vectors(llm, {"prompt_token_ids": long[-10:]}))
    with pytest.raises(ValueError, match="generation needs runner='generate'"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(checkpoints["llama"]), dtype="float32").embed("hi")


@pytest.mark.slow
def test_smollm2_equal_to_transformers() -> None:
    import transformers

    from pagedllm.prepare import prepare_smollm2

    path = prepare_smollm2()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["Once upon a time,", "The capital of France is Paris.", "def fibonacci(n):" * 5]
    ids = [tok(t).input_ids for t in texts]
    hf = hf_base(path)
    for pooling in ("LAST", "MEAN"):
        config = PoolerConfig(pooling_type=pooling)
        llm = LLM(str(path), dtype="float32", runner="pooling", pooler_config=config)
        outs = llm.embed(texts)
        assert [o.prompt_token_ids for o in outs] == ids
        ours = torch.tensor([o.outputs.embedding for o in outs])
        assert_close(ours, hf_embeddings(hf, ids, pooling, True))


def test_serve_runner_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pagedllm serve --runner pooling` sets llm_engine's and llm's `runner` (PAGEDLLM_RUNNER)."""
    from pagedllm.cli import main
    from pagedllm.serving import launcher

    calls: list[dict[str, str]] = []
    monkeypatch.setattr(launcher, "serve", lambda model, *args: calls.append(args[4]) or 0)
    assert main(["serve", "--model", "/m", "--runner", "pooling"]) == 0
    assert main(["serve", "--model", "/m"]) == 0
    assert [c["PAGEDLLM_RUNNER"] for c in calls] == ["pooling", "generate"]
    with pytest.raises(SystemExit):
        main(["serve", "--model", "/m", "--runner", "embed"])
