"""The token-bitmask application: the CPU path and the Triton kernel (compiled on a GPU, else
run by the Triton interpreter on CPU tensors) against a bit-by-bit reference, `ban_`, and a
matcher fed a token its grammar refuses."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedllm.layers.bitmask import apply_token_bitmask_, ban_
from pagedllm.sampling_params import SamplingParams


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def random_case(vocab: int, rows: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits and bits on `rows`; the other rows' words are all ones (as the
    matchers fill them)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.full((5, words), -1, dtype=torch.int32)
    bits = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen)
    bitmask[rows] = bits.to(torch.int32)
    return logits, bitmask


@pytest.mark.parametrize("vocab", [384, 1000, 4096 + 37])
def test_cpu_path_matches_the_bits(vocab: int) -> None:
    logits, bitmask = random_case(vocab, [0, 3])
    want = reference(logits, bitmask, [0, 3])
    apply_token_bitmask_(logits, bitmask, [0, 3])
    assert torch.equal(logits, want)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton package")
@pytest.mark.parametrize("vocab", [384, 4096 + 37])
def test_triton_kernel_matches_the_bits(vocab: int) -> None:
    from pagedllm.layers.bitmask_kernel import apply_bitmask_triton

    logits, bitmask = random_case(vocab, [1, 4], seed=1)
    bitmask[0] = 0  # rows not named are not read
    want = reference(logits, bitmask, [1, 4])
    # compiled on a GPU (logits there, the bitmask on the host as the matchers fill it), else
    # interpreted on CPU tensors; a strided view, as the runner passes the sampled rows of a
    # larger logits tensor
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wide = torch.zeros(5, vocab + 8, device=device)
    wide[:, :vocab] = logits
    view = wide[:, :vocab]
    apply_bitmask_triton(view, bitmask, [1, 4])
    assert torch.equal(view.cpu(), want)
    assert not wide[:, vocab:].any()


def test_ban_keeps_a_row_that_would_be_empty() -> None:
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b110  # tokens 1 and 2
    bitmask[1, 0] = 0b010  # token 1 only
    ban_(bitmask, 0, [1, 40])
    ban_(bitmask, 1, [1])
    assert bitmask[0].tolist() == [0b100, 0]
    assert bitmask[1].tolist() == [0b010, 0]  # the grammar's only token stays


def test_a_token_the_grammar_refuses_fails_that_request_only(
    checkpoints: dict[str, Path],
) -> None:
    from pagedllm.structured.grammar import GrammarCompiler
    from pagedllm.structured.matchers import GrammarMatchers
    from pagedllm.text import Tokenizer

    tok = Tokenizer.from_model_dir(checkpoints["llama"])
    compiler = GrammarCompiler(tok.to_json(), 384, [1])
    matchers = GrammarMatchers(compiler)
    params = SamplingParams(structured_outputs={"choice": ["fox"]})
    assert params.structured_outputs is not None
    for request_id in ("r", "o"):  # as the engine does when a request arrives
        matchers.start(request_id, compiler.matcher(params.structured_outputs))
    row = SimpleNamespace(request_id="r", params=params, output_token_ids=[], spec_token_ids=[])
    other = SimpleNamespace(request_id="o", params=params, output_token_ids=[], spec_token_ids=[])
    free = SimpleNamespace(
        request_id="f", params=SamplingParams(), output_token_ids=[], spec_token_ids=[]
    )
    masks = matchers.fill([free, row])
    assert masks is not None and masks.bitmask.shape == (2, 12) and not masks.failed
    assert masks.bitmask[0].eq(-1).all() and not masks.bitmask[1].eq(-1).all()
    assert matchers.fill([free]) is None
    row.output_token_ids = tok.encode("dog", add_special_tokens=False)
    masks = matchers.fill([row, other])
    assert masks is not None and list(masks.failed) == ["r"]
    assert masks.failed["r"].startswith("the structured-output constraint failed")
    assert not masks.bitmask[1].eq(-1).all()  # the other request's mask is filled
    # every constrained row failed: nothing to fill
    masks = matchers.fill([row])
    assert masks is not None and list(masks.failed) == ["r"]
    matchers.close()


def test_a_drafting_request_gets_a_mask_per_verified_position(
    checkpoints: dict[str, Path],
) -> None:
    """Speculation: one mask row per draft position, each the grammar's after the drafts before
    it (a fresh matcher fed them is the oracle); no mask after a draft the grammar refuses;
    the request's matcher is left where it was."""
    from pagedllm.structured.grammar import GrammarCompiler
    from pagedllm.structured.matchers import GrammarMatchers
    from pagedllm.text import Tokenizer

    tok = Tokenizer.from_model_dir(checkpoints["llama"])
    compiler = GrammarCompiler(tok.to_json(), 384, [1])
    matchers = GrammarMatchers(compiler, [1])
    params = SamplingParams(structured_outputs={"regex": "(cat|dog)( (cat|dog))*"})
    spec = params.structured_outputs
    assert spec is not None
    matchers.start("r", compiler.matcher(spec))
    good = tok.encode("cat dog cat", add_special_tokens=False)
    bad = tok.encode(" fox", add_special_tokens=False)
    free = SimpleNamespace(request_id="f", params=SamplingParams(), output_token_ids=[])
    free.spec_token_ids = [5, 6]
    row = SimpleNamespace(request_id="r", params=params, output_token_ids=good[:1])
    row.spec_token_ids = [*good[1:], *bad]
    masks = matchers.fill([free, row])
    assert masks is not None and not masks.failed
    assert masks.bitmask.shape == (3 + len(row.spec_token_ids) + 1, 12)
    assert masks.bitmask[:3].eq(-1).all()  # the free request's rows
    at = 3
    for j in range(len(good)):  # rows 0 .. len(good) - 1 of the request: all in the grammar
        oracle = compiler.matcher(spec)
        assert oracle.consume_tokens(good[: j + 1])
        want = torch.zeros(12, dtype=torch.int32)
        oracle.unsafe_compute_mask_ptr(want.data_ptr(), 48)
        assert torch.equal(masks.bitmask[at + j], want), j
        assert not want.eq(-1).all()
    # the first bad draft is refused by the row before it: no mask after it
    assert masks.bitmask[at + len(good) :].eq(-1).all()
    # rolled back: without drafts, the request's one row is its first row above
    row.spec_token_ids = []
    again = matchers.fill([row])
    assert again is not None and torch.equal(again.bitmask[0], masks.bitmask[at])
    matchers.close()
