"""Beam search (issue 53): vLLM's `LLM.beam_search` rule, equal to HF's beam search where no
EOS is involved, with beams sharing KV blocks (fork + copy on write) in the paged cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import hf_model, make_checkpoint, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams, get_beam_search_score, select_candidates

VOCAB = 384
WIDTH, STEPS = 4, 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("beam") / "llama", "llama")


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    return hf_model(ckpt)


def make_llm(path: Path, **knobs: Any) -> LLM:
    args: dict[str, Any] = dict(dtype="float32", device="cpu", num_kv_blocks=256, block_size=4)
    return LLM(str(path), **{**args, **knobs})


def hf_beams(
    hf: Any,
    prompt: list[int],
    width: int,
    steps: int,
    lp: float,
    early_stopping: bool | str = "never",
    eos: int | None = None,  # None: no EOS, where vLLM's rule and HF's agree
    n: int | None = None,
) -> Any:
    """HF's beam search: `n` (default `width`) rows, padded with EOS after one."""
    with torch.no_grad():
        return hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=n or width,
            max_new_tokens=steps,
            do_sample=False,
            early_stopping=early_stopping,
            length_penalty=lp,
            eos_token_id=eos,
            pad_token_id=1 if eos is None else eos,
            output_scores=True,
            return_dict_in_generate=True,
        )


def run(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> list[Any]:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.pool.num_used_blocks == 0, "blocks leaked"
    assert not llm.engine.scheduler.beams.groups
    return outs


def assert_hf_equal(hf: Any, prompts: list[list[int]], outs: list[Any], lp: float) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_beams(hf, prompt, WIDTH, STEPS, lp)
        assert len(out.sequences) == WIDTH
        for i, seq in enumerate(out.sequences):
            assert seq.tokens == ref.sequences[i].tolist()  # prompt + output, same order
            # HF's score: cum_logprob / output_len ** length_penalty
            assert seq.cum_logprob / STEPS**lp == pytest.approx(
                float(ref.sequences_scores[i]), abs=1e-3
            )
            assert len(seq.logprobs) == STEPS and seq.finish_reason == "length"


KNOBS = {
    "default": {},
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "no_prefix_caching": dict(enable_prefix_caching=False, block_size=16),
}


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
def test_equal_to_hf(ckpt: Path, hf: Any, knobs: dict[str, Any]) -> None:
    prompts = random_prompts(3, (5, 22), VOCAB, seed=1)
    with make_llm(ckpt, **knobs) as llm:
        outs = run(llm, prompts, BeamSearchParams(WIDTH, STEPS, ignore_eos=True))
    assert_hf_equal(hf, prompts, outs, 1.0)


@pytest.mark.parametrize("lp", [0.5, 2.0])
def test_length_penalty(ckpt: Path, hf: Any, lp: float) -> None:
    prompts = random_prompts(1, (9, 9), VOCAB, seed=2)
    with make_llm(ckpt) as llm:
        outs = run(llm, prompts, BeamSearchParams(WIDTH, STEPS, ignore_eos=True, length_penalty=lp))
    assert_hf_equal(hf, prompts, outs, lp)


def test_prefix_cache_hits(ckpt: Path, hf: Any) -> None:
    """A second search over the same prompt (and one sharing its start) hits the blocks the
    first left in the prefix cache: same results."""
    base = random_prompts(1, (13, 13), VOCAB, seed=4)[0]
    prompts = [base, base, [*base[:9], 5, 6, 7]]
    with make_llm(ckpt) as llm:
        first = run(llm, prompts[:1], BeamSearchParams(WIDTH, STEPS, ignore_eos=True))
        hits = llm.engine.scheduler.kv.prefix_hits
        again = run(llm, prompts, BeamSearchParams(WIDTH, STEPS, ignore_eos=True))
        assert llm.engine.scheduler.kv.prefix_hits > hits
    assert [s.tokens for s in again[0].sequences] == [s.tokens for s in first[0].sequences]
    assert_hf_equal(hf, prompts, again, 1.0)


def peak_blocks(llm: LLM, fn: Any) -> int:
    kv = llm.engine.scheduler.kv
    kv.peak_used_blocks = 0
    fn()
    return kv.peak_used_blocks


def test_blocks_shared(ckpt: Path) -> None:
    """A width-4 group holds fewer blocks than 4 independent sequences of the same lengths;
    a partly filled block is copied when two beams write into it."""
    prompt = random_prompts(1, (30, 30), VOCAB, seed=5)[0]
    with make_llm(ckpt, enable_prefix_caching=False) as llm:
        copies: list[tuple[int, int]] = []
        kv = llm.engine.scheduler.kv
        take = kv.take_copies

        def counting_take() -> list[tuple[int, int]]:
            out = take()
            copies.extend(out)
            return out

        kv.take_copies = counting_take  # type: ignore[method-assign]
        params = BeamSearchParams(WIDTH, STEPS, ignore_eos=True)
        shared = peak_blocks(llm, lambda: run(llm, [prompt], params))
        indep = SamplingParams(n=WIDTH, max_tokens=STEPS, ignore_eos=True, seed=0)
        unshared = peak_blocks(llm, lambda: llm.generate({"prompt_token_ids": prompt}, indep))
        llm.engine.check_integrity()
    # 30 + 10 tokens in blocks of 4: 4 independent sequences hold 4 * 10 blocks at the end;
    # the group shares the prompt's 8 blocks and holds at most 4 * 3 more of its own
    assert unshared == WIDTH * 10
    assert shared <= 8 + WIDTH * 3 < unshared
    assert copies, "no copy on write"


def test_preemption(ckpt: Path) -> None:
    """A pool too small for four groups at once: groups are preempted, recomputed and ends
    with the same beams."""
    prompts = random_prompts(4, (14, 14), VOCAB, seed=6)
    params = BeamSearchParams(WIDTH, STEPS, ignore_eos=True)
    with make_llm(ckpt) as llm:
        expected = run(llm, prompts, params)
    for caching in (True, False):
        with make_llm(ckpt, num_kv_blocks=24, enable_prefix_caching=caching) as llm:
            got = run(llm, prompts, params)
            assert llm.engine.scheduler.num_preemptions > 0
        for a, b in zip(expected, got, strict=True):
            assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
            for x, y in zip(a.sequences, b.sequences, strict=True):
                assert x.cum_logprob == pytest.approx(y.cum_logprob, abs=1e-4)


def vllm_reference(hf: Any, prompt: list[int], width: int, steps: int, eos: int) -> list[Any]:
    """vLLM's rule, recomputing every beam from scratch with HF each step (the oracle where
    EOS ends beams)."""
    live: list[tuple[list[int], float]] = [(prompt, 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(steps):
        cands = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (done if t == eos else cands).append(([*tokens, t], cum + lp))
        live = sorted(cands, key=lambda c: c[1], reverse=True)[:width]
    ranked = sorted(
        done + live, key=lambda c: get_beam_search_score(c[0], c[1], {eos}), reverse=True
    )
    return ranked[:width]


@pytest.fixture(scope="module")
def eos_ckpt(tmp_path_factory: pytest.TempPathFactory, hf: Any) -> Iterator[tuple[Path, int]]:
    """The same weights with EOS set to a token the first prompt's beams propose early."""
    prompt = random_prompts(1, (8, 8), VOCAB, seed=7)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    eos = int(logits.topk(3).indices[2])
    path = make_checkpoint(tmp_path_factory.mktemp("eos") / "llama", "llama", eos_token_id=eos)
    yield path, eos


def test_eos_ends_beams_as_vllm(eos_ckpt: tuple[Path, int], hf: Any) -> None:
    path, eos = eos_ckpt
    prompt = random_prompts(1, (8, 8), VOCAB, seed=7)[0]
    with make_llm(path) as llm:
        (out,) = run(llm, [prompt], BeamSearchParams(WIDTH, 6))
    ref = vllm_reference(hf, prompt, WIDTH, 6, eos)
    assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
    for seq, (_, cum) in zip(out.sequences, ref, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] == eos for s in stopped)
    assert out.sequences[0].text is not None


def test_rule() -> None:
    chosen, ended = select_candidates(
        [0.0, -1.0], [[(5, -0.1), (1, -0.2)], [(7, -0.05), (8, -3.0)]], 2, {1}
    )
    assert chosen == [(0, 5, -0.1), (1, 7, -1.05)]
    assert ended == [(0, 1, -0.2)]
    # vLLM's length: prompt and output, a final EOS not counted
    assert get_beam_search_score([3, 4, 1], -2.0, {1}, 1.0) == -1.0
    assert get_beam_search_score([3, 4, 5, 6], -2.0, {1}, 0.5) == -1.0
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)


def test_refuses(ckpt: Path) -> None:
    with make_llm(ckpt, max_num_seqs=4) as llm:
        with pytest.raises(ValueError, match="beam_width"):
            llm.beam_search([{"prompt_token_ids": [2, 3]}], BeamSearchParams(5, 4))
        with pytest.raises(ValueError, match="beam_width must be at most 10"):
            llm.beam_search([{"prompt_token_ids": [2, 3]}], BeamSearchParams(11, 4))
        with pytest.raises(ValueError, match="prompt token ids"):
            llm.beam_search([{"prompt_token_ids": [VOCAB]}], BeamSearchParams(2, 4))
        llm.engine.check_integrity()


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.slow
def test_smollm2_equal_to_hf() -> None:
    """The real default model: HF's beam search without EOS (ours with `ignore_eos`)."""
    from pagedllm.prepare import prepare_smollm2

    path = prepare_smollm2()
    # NOTE: one thread: on two cores other jobs share, two OpenMP threads made HF's beam
    # search ~20x slower (36 s against 1.5 s)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        smollm2_beams(path)
    finally:
        torch.set_num_threads(threads)


def smollm2_beams(path: Path) -> None:
    import transformers

    hf_smol = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = make_llm(path, num_kv_blocks=64, block_size=16)
    prompts = [llm.engine.tokenizer.encode(p) for p in SMOL_PROMPTS]
    steps = 8
    outs = run(llm, prompts, BeamSearchParams(WIDTH, steps, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_beams(hf_smol, prompt, WIDTH, steps, 1.0)
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        ours = [s.cum_logprob / steps for s in out.sequences]
        assert ours == pytest.approx(ref.sequences_scores.tolist(), abs=1e-3)
