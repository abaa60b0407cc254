"""Log-probs and token-id prompts through `pagedllm openai` (test_openai's real tritonserver and
gateway, tiny llama fp32), read with the official `openai` client, streamed and not: every
log-prob and top alternative equals HF transformers' log_softmax of the model's logits on the
same ids (1e-4). The sampled ids come from the offline API with the same seeds (the gateway's
seeded samples equal them, test_openai); greedy ones from HF's greedy generate."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import test_openai
import torch
from test_openai import MAX_TOKENS, MESSAGES, MODEL, PROMPT, rendered_chat

from conftest import TINY, hf_greedy, hf_model
from pagedllm import LLM, SamplingParams
from pagedllm.openai.tokens import TokenTexts, byte_level_alphabet
from pagedllm.text.tokenizer import Tokenizer

model_dir, server, gateway = test_openai.model_dir, test_openai.server, test_openai.gateway
client, llm, tokenizer = test_openai.client, test_openai.llm, test_openai.tokenizer

TOL = 1e-4
PROMPTS = [PROMPT, "Paged attention stores"]
SAMPLED: dict[str, Any] = {"temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return hf_model(model_dir)


def hf_log_softmax(hf: Any, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float64: row j scores the token at position j + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)


def sampled_ids(llm: LLM, prompt: str, seed: int) -> list[int]:
    """The output ids of a seeded sample (the gateway's sample i has seed `seed + i`)."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def greedy_ids(hf: Any, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return hf_greedy(hf, [prompt_ids], max_tokens, eos=None)[0]


# --- completions ------------------------------------------------------------------------------


@dataclass
class Choice:
    """One completions choice, its streamed chunks joined."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, choice: Any) -> None:
        self.text += choice.text
        logprobs = choice.logprobs
        if logprobs is not None:
            self.tokens += logprobs.tokens
            self.token_logprobs += logprobs.token_logprobs
            self.top_logprobs += logprobs.top_logprobs
            self.text_offset += logprobs.text_offset


def completion(client: openai.OpenAI, stream: bool, **kwargs: Any) -> dict[int, Choice]:
    """The choices of a completions request, by index."""
    choices: dict[int, Choice] = {}
    if stream:
        for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
            for c in chunk.choices:
                choices.setdefault(c.index, Choice()).add(c)
    else:
        for c in client.completions.create(model=MODEL, **kwargs).choices:
            choices.setdefault(c.index, Choice()).add(c)
    return dict(sorted(choices.items()))


def check_completion(
    choice: Choice, hf: Any, tokenizer: Tokenizer, ids: list[int], start: int, n: int
) -> int:
    """`choice`'s log-probs of ids[start:] (ids: prompt + output) against HF: vLLM's shape,
    each top dict the chosen token then the n best, keyed by token string. Returns how many
    chosen tokens were outside the n best."""
    text = {i: tokenizer.decode([i], False) for i in range(TINY["vocab_size"])}
    rows = hf_log_softmax(hf, ids)
    assert choice.tokens == [text[i] for i in ids[start:]]
    lengths = [len(t) for t in choice.tokens]
    assert choice.text_offset == [sum(lengths[:k]) for k in range(len(lengths))]
    outside = 0
    for k, t in enumerate(range(start, len(ids))):
        if t == 0:  # an echoed prompt's first token: nothing predicts it
            assert choice.token_logprobs[k] is None and choice.top_logprobs[k] is None
            continue
        row, token = rows[t - 1], ids[t]
        assert choice.token_logprobs[k] == pytest.approx(row[token].item(), abs=TOL)
        best = row.topk(n).indices.tolist() if n else []
        expected = {text[token]: row[token].item()}
        for i in best:
            if i != token:
                expected[text[i]] = row[i].item()
        assert choice.top_logprobs[k] == pytest.approx(expected, abs=TOL)
        outside += token not in best
    return outside


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_match_hf(
    client: openai.OpenAI, llm: LLM, hf: Any, tokenizer: Tokenizer, stream: bool
) -> None:
    """Two prompts, n=2 seeded samples, logprobs=3: the chosen tokens' log-probs and the 3 best
    alternatives at every step; a sampled token outside the 3 best is in its dict too."""
    choices = completion(
        client, stream, prompt=PROMPTS, n=2, max_tokens=MAX_TOKENS, logprobs=3, **SAMPLED
    )
    assert list(choices) == [0, 1, 2, 3]
    outside = 0
    for index, choice in choices.items():
        prompt = PROMPTS[index // 2]
        prompt_ids = tokenizer.encode(prompt)
        ids = prompt_ids + sampled_ids(llm, prompt, 7 + index % 2)
        outside += check_completion(choice, hf, tokenizer, ids, len(prompt_ids), 3)
    assert outside > 0  # near-uniform random logits: most sampled tokens are not in the top 3


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_logprobs_match_hf(
    client: openai.OpenAI, hf: Any, tokenizer: Tokenizer, stream: bool
) -> None:
    """echo with logprobs=2: the prompt's tokens come first (the first with null log-prob and
    top), then the generated ones; for text prompts and token-id prompts (echoed decoded)."""
    rng = random.Random(0)
    id_prompts = [tokenizer.encode(PROMPT), [rng.randrange(2, 368) for _ in range(9)]]
    for prompts in (PROMPTS, id_prompts):
        choices = completion(
            client, stream, prompt=prompts, echo=True, max_tokens=4, logprobs=2, **GREEDY
        )
        assert list(choices) == [0, 1]
        for index, choice in choices.items():
            prompt = prompts[index]
            if isinstance(prompt, str):
                prompt_ids, prompt_text = tokenizer.encode(prompt), prompt
            else:
                prompt_ids, prompt_text = prompt, tokenizer.decode(prompt, False)
            out = greedy_ids(hf, prompt_ids, 4)
            assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
            check_completion(choice, hf, tokenizer, prompt_ids + out, 0, 2)


def test_completion_logprobs_limits(client: openai.OpenAI, hf: Any, tokenizer: Tokenizer) -> None:
    """logprobs up to vLLM's 20 (OpenAI stops at 5); 21 is refused naming the range."""
    choice = completion(client, False, prompt=PROMPT, max_tokens=3, logprobs=20, **GREEDY)[0]
    prompt_ids = tokenizer.encode(PROMPT)
    check_completion(choice, hf, tokenizer, prompt_ids + greedy_ids(hf, prompt_ids, 3), 8, 20)
    for kwargs in ({"logprobs": 21}, {"logprobs": -1}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
        assert error.value.param == "logprobs" and "valid range [0, 20]" in error.value.message


# --- chat -------------------------------------------------------------------------------------


def hf_token_bytes(model_dir: Path) -> dict[int, list[int]]:
    """Every id's raw bytes by transformers' own byte-level alphabet (the oracle of `bytes`)."""
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    out = {}
    for i in range(TINY["vocab_size"]):
        piece = hf_tokenizer.convert_ids_to_tokens(i)
        out[i] = [byte_of[c] for c in piece] if piece else []
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_match_hf(
    client: openai.OpenAI,
    llm: LLM,
    hf: Any,
    tokenizer: Tokenizer,
    model_dir: Path,
    stream: bool,
) -> None:
    """n=2 seeded samples with top_logprobs=4: each token's string, log-prob and raw bytes (a
    byte-level token inside a character: its own bytes, not U+FFFD's), and the 4 best
    alternatives, best first."""
    kwargs = dict(
        model=MODEL, messages=MESSAGES, n=2, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=4
    )
    contents: dict[int, list[Any]] = {0: [], 1: []}
    if stream:
        for chunk in client.chat.completions.create(stream=True, **kwargs, **SAMPLED):
            for c in chunk.choices:
                contents[c.index] += c.logprobs.content if c.logprobs else []
    else:
        for c in client.chat.completions.create(**kwargs, **SAMPLED).choices:
            assert c.logprobs is not None and c.logprobs.content is not None
            contents[c.index] = c.logprobs.content
    prompt = rendered_chat(model_dir, tokenizer)
    prompt_ids = tokenizer.encode(prompt)
    raw = hf_token_bytes(model_dir)
    partial = 0
    for index, content in contents.items():
        out = sampled_ids(llm, prompt, 7 + index)
        rows = hf_log_softmax(hf, prompt_ids + out)
        assert len(content) == len(out) == MAX_TOKENS
        for j, (entry, token) in enumerate(zip(content, out, strict=True)):
            row = rows[len(prompt_ids) - 1 + j]
            assert entry.token == tokenizer.decode([token], False)
            assert entry.bytes == raw[token]
            assert entry.logprob == pytest.approx(row[token].item(), abs=TOL)
            partial += "\ufffd" in entry.token
            values, best = row.topk(4)
            assert [t.bytes for t in entry.top_logprobs] == [raw[i] for i in best.tolist()]
            assert [t.token for t in entry.top_logprobs] == [
                tokenizer.decode([i], False) for i in best.tolist()
            ]
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                values.tolist(), abs=TOL
            )
    assert partial > 0  # some tokens hold part of a character: their bytes are the raw ones


def test_chat_logprobs_limits(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=20, **GREEDY
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and all(len(c.top_logprobs) == 20 for c in content)
    values = [t.logprob for t in content[0].top_logprobs]
    assert values == sorted(values, reverse=True) and content[0].logprob == values[0]  # greedy
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21
        )
    assert error.value.param == "top_logprobs" and "valid range [0, 20]" in error.value.message


# --- token-id prompts ---------------------------------------------------------------------------


def test_token_id_prompts(client: openai.OpenAI, hf: Any, tokenizer: Tokenizer) -> None:
    """A list of ids, and a list of such lists: the same outputs as HF greedy on those ids
    (the text prompt's ids give the text prompt's answer); usage counts the ids."""
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)

    rng = random.Random(1)
    batch = [[rng.randrange(2, 368) for _ in range(n)] for n in (1, 5, 17)]
    out = client.completions.create(
        model=MODEL, prompt=batch, max_tokens=MAX_TOKENS, logprobs=0, **GREEDY
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, prompt in zip(out.choices, batch, strict=True):
        expected = greedy_ids(hf, prompt)
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == [tokenizer.decode([i], False) for i in expected]
    assert out.usage is not None and out.usage.prompt_tokens == 1 + 5 + 17


# --- token strings and bytes, without a server -----------------------------------------------


def test_raw_bytes_rejoin_multibyte_text(model_dir: Path, tokenizer: Tokenizer) -> None:
    """The bytes of consecutive tokens joined are the text's UTF-8, also where tokens split a
    character (CJK, emoji in the tiny byte-level BPE); the byte alphabet is GPT-2's."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}
    texts = TokenTexts(tokenizer, model_dir)
    assert texts.vocab_size == 368  # the tokenizer's ids (the model has 384 rows)
    text = "Grüße aus Köln! 東京は晴れです。 😀🚀"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in texts.text(i) for i in ids)
    assert b"".join(bytes(texts.raw_bytes(i)) for i in ids) == text.encode()


def test_raw_bytes_of_byte_fallback_tokens(tmp_path: Path) -> None:
    """A SentencePiece-style tokenizer's byte-fallback token (`<0xE6>`) is that byte."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "a": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    hf.save(str(tmp_path / "tokenizer.json"))
    texts = TokenTexts(Tokenizer.from_model_dir(tmp_path), tmp_path)
    ids = [2 + b for b in "東".encode()]
    assert [texts.text(i) for i in ids] == ["\ufffd"] * 3
    assert [texts.raw_bytes(i) for i in ids] == [[b] for b in "東".encode()]
    assert texts.raw_bytes(1) == [ord("a")]
