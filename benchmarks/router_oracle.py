"""The offline engine's greedy answers as the oracle of benchmarks/router_bench.py, with the
margin by which it chose each token. The served engine computes the same model, but its
4-bit weights meet activations rounded per batch shape (a prefill of 400 tokens and one of a
10-token suffix after a prefix-cache hit take different kernels), so where the offline
engine's two best tokens are nearly tied the served answer may take the other one and part
from there. A served answer is `exact`, or `parted` where the offline engine chose its token
by a margin (top-1 minus top-2 log-prob) that the report lists: parting where the offline
engine was nearly undecided is the served engine's batch-shape numerics, a parting at a wide
margin would be a wrong answer."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm import LLM, SamplingParams
from pagedllm.prepare import prepare_smollm2


@dataclass(frozen=True)
class Answer:
    text: str
    token_texts: list[str]  # each generated token's text (joined: `text`)
    margins: list[float]  # top-1 minus top-2 log-prob at each generated token


def offline_answers(prompts: list[str], max_tokens: int) -> dict[str, Answer]:
    llm = LLM(str(prepare_smollm2()), quantization="gguf")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    out: dict[str, Answer] = {}
    for prompt, result in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        c = result.outputs[0]
        tok = llm.engine.tokenizer
        ids = list(c.token_ids)
        texts = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
        pieces = [b[len(a) :] for a, b in zip(["", *texts], texts, strict=False)]
        margins = []
        for step in c.logprobs or []:
            best = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
        out[prompt] = Answer(c.text, pieces, margins)
    return out


def judge(served: str | None, answer: Answer) -> tuple[str, float | None]:
    """("exact" | "parted", the offline margin where the texts part; None: nowhere to tell)."""
    if served == answer.text:
        return "exact", None
    done = ""
    for piece, margin in zip(answer.token_texts, answer.margins, strict=False):
        if served is None or not served.startswith(done + piece):
            return "parted", round(margin, 4)
        done += piece
    return "parted", None  # the served text goes on where the offline one ended
