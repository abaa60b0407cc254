"""`bad_words` / `bad_words_ids`: vLLM's tokenization rule and ban (a banned sequence's last
token goes to -inf where the output tokens end with the rest of it), in the sampler on hand-made
logits, and end to end on the tiny Llama checkpoint against HF `generate(bad_words_ids=...)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY, hf_greedy, hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.layers import sampler as sampler_mod
from pagedllm.layers.sampler import Sampler, SampleRequest, SamplingMetadata, bad_word_bans
from pagedllm.sampling_params import MAX_BAD_WORD_CHARS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS

CPU = torch.device("cpu")
V = 50
MAX_NEW = 12
EOS = TINY["eos_token_id"]


def banning(ids: list[list[int]], **kw: Any) -> SamplingParams:
    params = SamplingParams(bad_words_ids=ids, **kw)
    params.update_from_tokenizer(lambda s: [], V)
    return params


def row(params: SamplingParams, output: Sequence[int] = (), prompt: Sequence[int] = (2,)) -> Any:
    return SampleRequest(params, list(prompt), list(output), None)


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


# --- SamplingParams --------------------------------------------------------------------------


def test_update_from_tokenizer_follows_vllm() -> None:
    vocab = {
        "foo": [1, 2],
        " foo": [3, 2],  # a word mid-text: other first token, same count -> banned too
        "bar": [4],
        " bar": [5, 6],  # another count -> not added (vLLM's rule)
        "baz": [7],
        " baz": [7],  # the same first token -> not added
    }
    params = SamplingParams(bad_words=["foo", "  bar", "baz"], bad_words_ids=[[9, 8]])
    params.update_from_tokenizer(vocab.__getitem__, V)
    assert params.bad_words_token_ids == [[1, 2], [3, 2], [4], [7], [9, 8]]
    with pytest.raises(ValueError, match=r"bad_words token ids must be in \[0, 5\)"):
        params.update_from_tokenizer(vocab.__getitem__, 5)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        SamplingParams(bad_words="x").update_from_tokenizer(lambda s: [], V)


def test_bad_words_conversion() -> None:
    assert SamplingParams(bad_words="no").bad_words == ["no"]
    assert SamplingParams(bad_words=None).bad_words == []
    assert SamplingParams(bad_words=("a", "b")).bad_words == ["a", "b"]
    assert SamplingParams(bad_words_ids=[["3", 4]]).bad_words_ids == [[3, 4]]
    p = SamplingParams.from_dict({"bad_words": "x", "bad_words_ids": [[1]]})
    assert p.bad_words == ["x"] and p.bad_words_ids == [[1]] and p.bad_words_token_ids == []
    with pytest.raises(ValueError, match="unknown sampling parameters: _bad_words_token_ids"):
        SamplingParams.from_dict({"_bad_words_token_ids": [[1]]})
    SamplingParams(bad_words=["x" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS)
    SamplingParams(bad_words_ids=[[1] * MAX_BAD_WORD_TOKENS] * MAX_BAD_WORDS)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bad_words": [""]}, "bad_words must have 1 to 256 characters, not all whitespace"),
        ({"bad_words": ["ok", "  "]}, "not all whitespace"),
        ({"bad_words": ["x" * (MAX_BAD_WORD_CHARS + 1)]}, "bad_words must have 1 to 256"),
        ({"bad_words": ["x"] * (MAX_BAD_WORDS + 1)}, "at most 100 bad_words, got 101"),
        ({"bad_words": ["ok", 3]}, "bad_words must be a string or a list of strings"),
        ({"bad_words": {"a": 1}}, "bad_words must be a string or a list of strings"),
        ({"bad_words_ids": [1, 2]}, "bad_words_ids must be a list of lists of token ids"),
        ({"bad_words_ids": "1"}, "bad_words_ids must be a list of lists of token ids"),
        ({"bad_words_ids": [[1], []]}, "bad_words_ids sequences must have 1 to 64 token ids"),
        ({"bad_words_ids": [[1] * 65]}, "bad_words_ids sequences must have 1 to 64"),
        ({"bad_words_ids": [[-1]]}, "bad_words_ids must be non-negative"),
        ({"bad_words_ids": [["x"]]}, "bad_words_ids must be an integer"),
        ({"bad_words_ids": [[1]] * (MAX_BAD_WORDS + 1)}, "at most 100 bad_words_ids sequences"),
    ],
)
def test_bad_inputs_are_clear_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        SamplingParams(**kwargs)


# --- the sampler ------------------------------------------------------------------------------


def test_bans_match_output_tokens_only() -> None:
    params = banning([[5], [7, 8], [3, 7, 9]])
    assert bad_word_bans([row(params)]) == [(0, 5)]  # multi-token words need their prefix
    assert bad_word_bans([row(params, output=[1, 7])]) == [(0, 5), (0, 8)]
    assert bad_word_bans([row(params, output=[3, 7])]) == [(0, 5), (0, 8), (0, 9)]
    assert bad_word_bans([row(params, output=[7, 3])]) == [(0, 5)]
    # as vLLM: the prompt is not matched, even when it ends with a banned prefix
    assert bad_word_bans([row(params, output=[], prompt=[3, 7])]) == [(0, 5)]
    assert bad_word_bans([row(params, output=[7], prompt=[3])]) == [(0, 5), (0, 8)]
    other = row(SamplingParams())
    assert bad_word_bans([other, row(params, output=[7]), other]) == [(1, 5), (1, 8)]


def test_sampler_bans_before_penalties_and_keeps_raw_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    logits[:, 5] = 20.0  # every row's favourite
    logits[:, 8] = 15.0  # the runner-up
    rows = [
        row(banning([[5]], temperature=0, logprobs=2)),
        row(SamplingParams(temperature=0, logprobs=2)),  # same logits, no ban
        row(banning([[7, 5]], temperature=0, repetition_penalty=2.0), output=[5, 7]),
        row(banning([[5], [8]], temperature=2.0, frequency_penalty=1.0), output=[5, 5]),
    ]
    meta = SamplingMetadata.build(rows, V, CPU)
    out = Sampler()(logits.clone(), rows, meta)
    assert out.token_ids[:3] == [8, 5, 8]
    assert out.token_ids[3] not in (5, 8)
    # log-probs are those of the raw logits: the chosen token of row 0 ranks second there
    raw = logits.log_softmax(dim=-1)
    first, second = out.logprobs[:2]
    assert first is not None and second is not None
    ids, vals, chosen, rank = first
    assert ids == [5, 8] and vals == pytest.approx(raw[0, [5, 8]].tolist(), abs=1e-5)
    assert rank == 2 and chosen == pytest.approx(raw[0, 8].item(), abs=1e-5)
    assert second[3] == 1
    # a banned token is never drawn, whatever the temperature
    many = [row(banning([[5], [8]], temperature=5.0)) for _ in range(64)]
    hot = logits[:1].expand(64, V).clone()
    drawn = Sampler()(hot, many, SamplingMetadata.build(many, V, CPU)).token_ids
    assert 5 not in drawn and 8 not in drawn


def test_nothing_is_computed_without_bad_words(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(rows: Any) -> Any:
        raise AssertionError("bad_word_bans called for a batch without bad words")

    monkeypatch.setattr(sampler_mod, "bad_word_bans", fail)
    rows = [row(SamplingParams(temperature=0), output=[5, 7]) for _ in range(3)]
    meta = SamplingMetadata.build(rows, V, CPU)
    assert meta.banned is None


# --- end to end, against HF transformers --------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> Any:
    return hf_model(checkpoints["llama"])


def hf_banned(model: Any, prompt: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    """HF greedy with `bad_words_ids` (HF matches prefixes against prompt + output: callers
    check that the prompt holds none of the prefix tokens, so both rules agree)."""
    prefix_tokens = {t for seq in bad_words_ids for t in seq[:-1]}
    assert not prefix_tokens & set(prompt), "the prompt could complete a banned prefix in HF"
    assert [EOS] not in bad_words_ids  # HF drops a banned EOS
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            bad_words_ids=bad_words_ids,
            pad_token_id=EOS,
        )
    return ids[0, len(prompt) :].tolist()


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def run(llm: LLM, prompts: list[Any], params: list[SamplingParams]) -> list[list[int]]:
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_e2e_banned_token_ids_match_hf_and_spare_other_rows(llm: LLM, oracle: Any) -> None:
    prompts = random_prompts(3, (5, 20), TINY["vocab_size"], seed=3)
    free = run(llm, prompts, [greedy()] * 3)
    assert free == hf_greedy(oracle, prompts, MAX_NEW, eos=None)
    target = free[1]
    single = [[target[3]]]
    pair = [target[5:7]]  # a two-token sequence: banned only right after its first token
    assert target[5] not in prompts[1]
    for banned in (single, pair):
        params = [greedy(), greedy(bad_words_ids=banned), greedy()]
        got = run(llm, prompts, params)
        assert got[1] != target and not any(contains(got[1], seq) for seq in banned)
        assert got[1][:3] == target[:3]  # the same until the first ban bites
        assert got[1] == hf_banned(oracle, prompts[1], banned)
        assert got[0] == free[0] and got[2] == free[2]  # the other rows are unaffected


def resolve(llm: LLM, word: str) -> list[list[int]]:
    params = SamplingParams(bad_words=[word])
    params.update_from_tokenizer(llm.engine._encode_word, TINY["vocab_size"])
    return params.bad_words_token_ids


def produced_word(llm: LLM, ids: list[int], num_tokens: int) -> str:
    """A word the model produced: the first `num_tokens` output tokens in a row that spell
    letters only and are among the word's banned sequences."""
    tok = llm.get_tokenizer()
    for i in range(len(ids) - num_tokens + 1):
        run_ids = ids[i : i + num_tokens]
        word = tok.decode(run_ids).strip()
        if word.isalpha() and len(word) > 1 and run_ids in resolve(llm, word):
            return word
    raise AssertionError(f"no {num_tokens}-token word in the unconstrained output")


@pytest.mark.parametrize(
    ("text", "num_tokens"), [("The quick brown fox", 1), ("Paged attention stores", 2)]
)
@pytest.mark.parametrize("prompt_as_ids", [False, True])
def test_e2e_bad_words_strings_match_hf(
    llm: LLM, oracle: Any, text: str, num_tokens: int, prompt_as_ids: bool
) -> None:
    prompt_ids = llm.get_tokenizer().encode(text)
    prompt: str | list[int] = prompt_ids if prompt_as_ids else text
    (free,) = run(llm, [prompt], [greedy()])
    word = produced_word(llm, free, num_tokens)
    banned = resolve(llm, word)
    assert any(contains(free, seq) for seq in banned)  # the ban has something to bite
    params = greedy(bad_words=[word])
    (got,) = run(llm, [prompt], [params])
    assert not any(contains(got, seq) for seq in banned)
    assert got == hf_banned(oracle, prompt_ids, banned)
    assert params.bad_words_token_ids == []  # the caller's object is left as given


def test_engine_rejects_ids_outside_the_vocabulary(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    params = greedy(bad_words_ids=[[3], [TINY["vocab_size"]]])
    with pytest.raises(ValueError, match=r"bad_words token ids must be in \[0, 384\)"):
        engine.add_request("oov", [5, 6, 7], params)
    assert not engine.output_processor.has("oov") and not engine.has_unfinished_requests()
