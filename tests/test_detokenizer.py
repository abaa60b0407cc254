"""Incremental detokenization and stop strings: streamed text == full decode, for SmolLM2's
byte-level BPE and a byte-fallback SentencePiece-style tokenizer; CJK, emoji, accents."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.prepare import prepare_smollm2
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.text import Tokenizer
from pagedllm.text.detokenizer import (
    CONTEXT,
    IncrementalDetokenizer,
    find_stop,
    stop_holdback,
    window_text,
)

TEXTS = [
    "Hello, world! The quick brown fox.",
    "东京は晴れです。北京欢迎你！",
    "Emoji: 😀🚀👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "Crème brûlée, naïve façade — “quotes” ½ ∑ ∞",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "mixed中文and English😀text",
]


def byte_fallback_tokenizer(tmp: Path) -> Tokenizer:
    """A Llama-2-style SentencePiece BPE: ▁ for spaces, unknown characters as <0xNN> bytes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world and friends"] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=120,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz▁"),
    )
    base = HFTokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(corpus, trainer)
    vocab = dict(base.get_vocab())
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        for m in __import__("json").loads(base.to_str())["model"]["merges"]
    ]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp / "tokenizer.json"))
    return Tokenizer.from_model_dir(tmp)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return prepare_smollm2()


@pytest.fixture(scope="module")
def tokenizers(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    return {
        "byte_level_bpe": Tokenizer.from_model_dir(smollm2),
        "byte_fallback_sp": byte_fallback_tokenizer(tmp_path_factory.mktemp("sp")),
    }


def stream(tok: Tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.add_tokens(ids[i : i + n], final=i + n >= len(ids)))
        i += n
    return deltas


@pytest.mark.parametrize("name", ["byte_level_bpe", "byte_fallback_sp"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(name: str, text: str, tokenizers: dict) -> None:
    tok = tokenizers[name]
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for chunking in ([1] * len(ids), [rng.randint(1, 4) for _ in ids]):
        deltas = stream(tok, ids, chunking)
        assert "".join(deltas) == tok.decode(ids)
        # no delta ever shows half a character
        assert all("\ufffd" not in d for d in deltas)


def test_byte_fallback_really_splits_characters(tokenizers: dict) -> None:
    tok = tokenizers["byte_fallback_sp"]
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) >= 4  # the emoji is four <0xNN> byte tokens
    # the first bytes alone are an incomplete character: held back...
    assert window_text(tok, [], ids[:2]) == ""
    # ...and emitted by the next call, which sees them in its window
    assert window_text(tok, ids[:2], ids[2:]) == "😀"
    # a flush shows what a full decode shows
    assert window_text(tok, [], ids[:2], final=True) == tok.decode(ids[:2])


def stateless(tok: Tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """The Triton detokenizer's view: each call gets only the CONTEXT ids before its chunk."""
    deltas, i = [], 0
    for n in chunks:
        if i >= len(ids):
            break
        window = ids[max(0, i - CONTEXT) : i]
        deltas.append(window_text(tok, window, ids[i : i + n], final=i + n >= len(ids)))
        i += n
    return deltas


@pytest.mark.parametrize("name", ["byte_level_bpe", "byte_fallback_sp"])
def test_stateless_windows_equal_full_decode(name: str, tokenizers: dict) -> None:
    tok = tokenizers[name]
    rng = random.Random(1)
    pool = "ab z,.\n éü中文東京😀🚀👨‍👩‍👧"
    texts = TEXTS + ["".join(rng.choice(pool) for _ in range(30)) for _ in range(20)]
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    if name == "byte_level_bpe":
        # arbitrary ids, invalid UTF-8 included. (A byte-fallback decoder turns a whole run of
        # byte tokens into U+FFFD when any byte is invalid: a later token can change the text
        # of earlier ones, which no streaming detokenizer can match.)
        cases += [[rng.randrange(tok.vocab_size) for _ in range(40)] for _ in range(20)]
    for ids in cases:
        for chunking in ([1] * len(ids), [rng.randint(1, 5) for _ in ids]):
            assert "".join(stateless(tok, ids, chunking)) == tok.decode(ids), ids


def test_leading_space_of_a_new_token_is_kept(tokenizers: dict) -> None:
    tok = tokenizers["byte_fallback_sp"]
    ids = tok.encode("the quick brown fox jumps", add_special_tokens=False)
    # decoding each token on its own drops the spaces (the TensorRT-LLM ensemble bug)...
    assert "".join(tok.decode([i]) for i in ids) != "the quick brown fox jumps"
    # ...the window keeps them
    assert "".join(stream(tok, ids, [1] * len(ids))) == "the quick brown fox jumps"


def test_find_stop_and_holdback() -> None:
    assert find_stop("abc STOP def", ["STOP"], 0) == (4, "STOP")
    # a stop string that began before the new text is still found
    assert find_stop("abc ST", ["STOP"], 5) is None
    assert find_stop("abc STOP", ["STOP"], 6) == (4, "STOP")
    # the earliest occurrence wins among overlapping stop strings
    assert find_stop("xx city of Nova", ["of Nova", "city"], 0) == (3, "city")
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello", ["world"]) == 0
    assert stop_holdback("ab", ["abc", "b"]) == 2
    assert stop_holdback("anything", []) == 0


# --- through the engine, on the real model ----------------------------------------------------

STORY = "Once upon a time,"  # greedy: " the city of Nova Haven was a thriving metropolis, ..."
CJK = "<|im_start|>user\n请用中文介绍一下北京。<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm(smollm2: Path) -> LLM:
    return LLM(str(smollm2), dtype="float32")


def run_stream(engine: LLMEngine, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("s", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stop", "include", "expected", "reason"),
    [
        (["Nova"], False, " the city of ", "Nova"),
        (["Nova"], True, " the city of Nova", "Nova"),
        (["ova Ha"], False, " the city of N", "ova Ha"),  # across a token boundary
        ([" the"], False, "", " the"),  # at the very first token
        (["of Nova", "city"], False, " the ", "city"),  # overlapping: earliest wins
        (
            ["thriving metropolis,", "metro"],
            False,
            " the city of Nova Haven was a thriving ",
            "metro",
        ),
    ],
)
def test_stop_strings(llm: LLM, stop: list[str], include: bool, expected: str, reason: str) -> None:
    out = llm.generate(
        STORY, greedy(stop=stop, include_stop_str_in_output=include), use_tqdm=False
    )[0].outputs[0]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == reason
    tok = llm.get_tokenizer()
    # generation stopped at the token that completed the stop string
    assert reason in tok.decode(out.token_ids)
    assert reason not in tok.decode(out.token_ids[:-1])
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("prompt", [STORY, CJK])
@pytest.mark.parametrize("stop", [[], ["Nova Haven", "北京"]])
def test_streamed_deltas_concatenate_to_final_text(llm: LLM, prompt: str, stop: list[str]) -> None:
    params = greedy(stop=stop, output_kind=RequestOutputKind.DELTA)
    outs = run_stream(llm.engine, prompt, params)
    deltas = [o.outputs[0].text for o in outs]
    final = llm.generate(prompt, greedy(stop=stop), use_tqdm=False)[0].outputs[0]
    assert "".join(deltas) == final.text
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == final.finish_reason
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(final.token_ids)
    if final.finish_reason == "length":
        # no stop string: the whole output, as the tokenizer decodes it
        assert final.text == llm.get_tokenizer().decode(final.token_ids)
    for s in stop:  # a held-back stop string never leaks into a delta
        assert all(s not in d for d in deltas)
    assert len(outs) == len(final.token_ids)  # one response per generated token


def test_cjk_output_and_incomplete_character_at_length(llm: LLM) -> None:
    out = llm.generate(CJK, greedy(), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert out.finish_reason == "length"
    assert sum("\u4e00" <= c <= "\u9fff" for c in out.text) > 10
    assert out.text == tok.decode(out.token_ids)
    # cut mid-character: the final text shows what a full decode shows
    assert out.text.endswith("\ufffd")


def test_cumulative_outputs_grow(llm: LLM) -> None:
    outs = run_stream(llm.engine, STORY, greedy(max_tokens=12, stop=["zzz"]))
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert (
        texts[-1] == llm.generate(STORY, greedy(max_tokens=12), use_tqdm=False)[0].outputs[0].text
    )


def test_eos_text_is_not_shown(llm: LLM) -> None:
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate(prompt, greedy(max_tokens=60), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == 2 and "<|im_end|>" not in out.text
    shown = llm.generate(prompt, greedy(max_tokens=60, skip_special_tokens=False), use_tqdm=False)[
        0
    ].outputs[0]
    assert "<|im_end|>" not in shown.text  # the stop token itself is never detokenized
    kept = llm.generate(
        prompt,
        greedy(max_tokens=60, skip_special_tokens=False, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text.endswith("<|im_end|>")


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate(STORY, greedy(max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[3]
    out = llm.generate(STORY, greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:4]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens masks the stop id until 6 tokens exist: generation runs past position 3
    late = llm.generate(
        STORY, greedy(stop_token_ids=[stop_id], min_tokens=6, max_tokens=20), use_tqdm=False
    )[0].outputs[0]
    assert len(late.token_ids) > 4 and stop_id not in late.token_ids[:6]
