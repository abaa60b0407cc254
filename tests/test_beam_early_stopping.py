"""Beam search with `early_stopping` (issue 53): HF's rule, which TensorRT-LLM's kernels follow,
equal to HF `generate(num_beams, num_return_sequences, length_penalty, early_stopping)` where
EOS ends beams. The setup is one where the three stops give three different answers (checked
on HF's side first), so a search that ignored `early_stopping` could not pass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_beam_search import hf_beams

from conftest import hf_model, make_checkpoint, random_prompts
from pagedllm import LLM
from pagedllm.beam_hf import Hypotheses, hf_select
from pagedllm.beam_search import BeamSearchParams, BeamSearchSequence

VOCAB = 384
# the first prompt of random_prompts(1, (8, 8), seed=0) with EOS = 183 and width 2: HF stops
# after 3 tokens with early_stopping=True, 6 with False, 10 with "never"
EOS, WIDTH, STEPS = 183, 2, 10
MODES: list[bool | str] = [True, False, "never"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """NOTE: on two shared cores, two OpenMP threads made HF's beam search ~20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the weights of test_beam_search's checkpoint (seed 0), EOS a token its beams propose
    return make_checkpoint(tmp_path_factory.mktemp("es") / "llama", "llama", eos_token_id=EOS)


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    return hf_model(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    with LLM(str(ckpt), dtype="float32", device="cpu", num_kv_blocks=128, block_size=4) as llm:
        yield llm
    llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.pool.num_used_blocks == 0, "blocks leaked"


def prompt() -> list[int]:
    return random_prompts(1, (8, 8), VOCAB, seed=0)[0]


def hf_search(hf: Any, tokens: list[int], early_stopping: bool | str, lp: float, n: int) -> Any:
    return hf_beams(hf, tokens, WIDTH, STEPS, lp, early_stopping, EOS, n)


def as_rows(seqs: list[BeamSearchSequence], width: int) -> list[list[int]]:
    """Our sequences as HF's rows: padded with EOS to the longest."""
    return [s.tokens + [EOS] * (width - len(s.tokens)) for s in seqs]


@pytest.mark.parametrize("lp", [1.0, 2.0])
def test_equal_to_hf(llm: LLM, hf: Any, lp: float) -> None:
    tokens = prompt()
    refs = {str(m): hf_search(hf, tokens, m, lp, WIDTH) for m in MODES}
    if lp == 1.0:  # the setup's point: three stops, three answers
        lengths = {m: r.sequences.shape[1] - len(tokens) for m, r in refs.items()}
        assert lengths == {"True": 3, "False": 6, "never": 10}
    stopped = []
    for mode in MODES:
        ref = refs[str(mode)]
        params = BeamSearchParams(WIDTH, STEPS, length_penalty=lp, early_stopping=mode)
        (out,) = llm.beam_search([{"prompt_token_ids": tokens}], params)
        assert as_rows(out.sequences, ref.sequences.shape[1]) == ref.sequences.tolist(), mode
        for seq, score in zip(out.sequences, ref.sequences_scores.tolist(), strict=True):
            num_output = len(seq.tokens) - len(tokens)  # HF counts the EOS
            assert seq.cum_logprob / num_output**lp == pytest.approx(score, abs=1e-3)
            assert seq.finish_reason == ("stop" if seq.tokens[-1] == EOS else "length")
            stopped.append(seq.finish_reason == "stop")
    assert any(stopped)


def test_num_return_sequences(llm: LLM, hf: Any) -> None:
    """HF's num_return_sequences < num_beams: the best of the beams, ours' first ones."""
    tokens = prompt()
    for mode in MODES:
        ref = hf_search(hf, tokens, mode, 1.0, 1)
        params = BeamSearchParams(WIDTH, STEPS, early_stopping=mode)
        (out,) = llm.beam_search([{"prompt_token_ids": tokens}], params)
        assert as_rows(out.sequences[:1], ref.sequences.shape[1]) == ref.sequences.tolist()


def test_rule() -> None:
    # parents 0 (cum 0) and 1 (cum -1); EOS = 1
    proposals = [[(5, -0.5), (1, -0.6), (6, -3.0)], [(1, -0.1), (7, -0.2), (8, -0.3)]]
    live, ended = hf_select([0.0, -1.0], proposals, 2, {1}, last=False)
    # K = 4 best: (0,5) -0.5, (0,1) -0.6, (1,1) -1.1, (1,7) -1.2: the EOS ranked 2nd ends, the
    # one ranked 3rd (outside the first `width`) is dropped
    assert ended == [(0, 1, -0.6)]
    assert live == [(0, 5, -0.5), (1, 7, -1.2)]
    assert hf_select([0.0, -1.0], proposals, 2, {1}, last=True) == (
        [],
        [(0, 5, -0.5), (0, 1, -0.6)],
    )
    hyps = Hypotheses(2, 1.0, False, max_tokens=10)
    hyps.add([(BeamSearchSequence([3, 1], cum_logprob=-2.0), 1)])
    assert not hyps.done(-0.5, 1)  # not full
    hyps.add([(BeamSearchSequence([3, 4, 1], cum_logprob=-3.0), 2)])
    assert not hyps.done(-2.0, 2)  # best live -2.0 / 2 = -1.0 beats the worst, -3.0 / 2
    assert hyps.done(-4.0, 2)  # -4.0 / 2 cannot
    never = Hypotheses(2, 1.0, "never", max_tokens=10)
    never.kept = list(hyps.kept)
    assert not never.done(-4.0, 2)  # "never": -4.0 / 10 (the longest) still could
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(2, 4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(2, 4, early_stopping=True, temperature=1.0)


def test_chunked_prefill_and_prefix_hits(ckpt: Path, hf: Any) -> None:
    """The same answers with the prompt prefilled in chunks of 3 tokens, then again from the
    prefix cache."""
    tokens = prompt()
    knobs = dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=3)
    with LLM(str(ckpt), dtype="float32", device="cpu", **knobs) as chunked:
        for mode in MODES:
            ref = hf_search(hf, tokens, mode, 1.0, WIDTH).sequences
            for _ in range(2):  # the second hits the first's blocks
                params = BeamSearchParams(WIDTH, STEPS, early_stopping=mode)
                (out,) = chunked.beam_search([{"prompt_token_ids": tokens}], params)
                assert as_rows(out.sequences, ref.shape[1]) == ref.tolist(), mode
        assert chunked.engine.scheduler.kv.prefix_hits > 0


@pytest.mark.slow
def test_smollm2_equal_to_hf() -> None:
    """The real default model, its chat EOS (<|im_end|>) ending beams: early_stopping True
    stops after 9 tokens, False runs to 12 with other beams."""
    import transformers

    from pagedllm.prepare import prepare_smollm2

    path = prepare_smollm2()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "Say yes or no: is the sky blue?"}]
    ids = list(
        tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    eos = tok.eos_token_id
    with LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16) as llm:
        rows = {}
        for mode in (True, False):
            ref = hf_beams(model.eval(), ids, 3, 12, 1.0, mode, eos)
            params = BeamSearchParams(3, 12, early_stopping=mode)
            (out,) = llm.beam_search([{"prompt_token_ids": ids}], params)
            width = ref.sequences.shape[1]
            rows[mode] = [s.tokens + [eos] * (width - len(s.tokens)) for s in out.sequences]
            assert rows[mode] == ref.sequences.tolist()
            ours = [s.cum_logprob / (len(s.tokens) - len(ids)) for s in out.sequences]
            assert ours == pytest.approx(ref.sequences_scores.tolist(), abs=1e-3)
        assert rows[True] != rows[False]
