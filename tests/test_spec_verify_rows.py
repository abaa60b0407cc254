"""Speculative verification as decode rows: a drafting request's k + 1 positions run as k + 1
decode rows over its block table (context lengths p + 1 .. p + k + 1), through the CPU's
one-call C++ decoder when the step has no prefill chunk. Each row's logits must be
transformers' at its position: a row that saw a later row's key/value, or missed its own
drafts' (written in the same layer), would differ."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from conftest import TINY, hf_model
from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.worker.model_runner import ModelRunner, order_batch

VOCAB = TINY["vocab_size"]
BLOCK = 4


def request(
    rid: str, tokens: list[int], start: int, blocks: list[int], drafts: int = 0
) -> ScheduledRequest:
    """`tokens[start:]` scheduled (the last `drafts` of them as a draft), sampled."""
    return ScheduledRequest(
        request_id=rid,
        token_ids=tokens[start:],
        start_pos=start,
        block_ids=blocks,
        sample=True,
        params=SamplingParams(temperature=0),
        prompt_token_ids=tokens[:start],
        output_token_ids=[],
        spec_token_ids=tokens[len(tokens) - drafts :] if drafts else [],
    )


def logits_of(runner: ModelRunner, batch: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
    """Each request's rows of logits from one step of `batch` (sampled rows only)."""
    batch = order_batch(batch)
    logits, _ = runner._forward(batch, [])
    out, r = {}, 0
    for s in batch:
        n = 1 + len(s.spec_token_ids)
        out[s.request_id] = logits[r : r + n]
        r += n
    return out


def test_verification_rows_match_transformers(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    runner = llm.engine.runner
    hf = hf_model(path)
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    # prompts of 9, 13, 6 and 10 tokens, each in blocks of its own (drafts cross blocks)
    prompts = {"a": tokens(9), "b": tokens(13), "c": tokens(6), "d": tokens(10)}
    tables, free = {}, iter(range(1, 64))
    for rid, p in prompts.items():
        tables[rid] = [next(free) for _ in range(-(-(len(p) + 8) // BLOCK))]
    logits_of(runner, [request(r, p, 0, tables[r]) for r, p in prompts.items()])  # prefill

    # a: its next token and a draft of 4; b: a draft of 2; c: a plain decode
    seqs = {
        "a": prompts["a"] + tokens(5),
        "b": prompts["b"] + tokens(3),
        "c": prompts["c"] + tokens(1),
    }
    drafts = {"a": 4, "b": 2, "c": 0}
    step = [request(r, s, len(prompts[r]), tables[r], drafts[r]) for r, s in seqs.items()]
    plan = runner.plan(order_batch(step))
    # a decode step (what a CUDA graph replays: graphs.can_run), a row per sampled position
    assert plan.num_decodes == len(plan.context_lens) == len(plan.logits_indices) == 5 + 3 + 1
    inputs = runner.inputs(plan)
    metadata = runner.backend.build_metadata(inputs)
    assert runner.backend.decode_batch(metadata) is not None  # the one-call C++ decoder
    assert runner.model._kernel_weights  # (which this model takes)
    decoded = logits_of(runner, step)

    # the same drafts again (their slots rewritten) beside a prefill chunk of d: the rows go
    # through the C++ decode attention, the chunk through the reference path
    chunk = request("d", prompts["d"] + tokens(6), len(prompts["d"]), tables["d"])
    mixed = logits_of(runner, [*step, chunk])
    seqs["d"] = prompts["d"] + chunk.token_ids

    with torch.no_grad():
        for rid, seq in seqs.items():
            want = hf(torch.tensor([seq])).logits[0, len(prompts[rid]) :]
            for got in (mixed[rid],) if rid == "d" else (decoded[rid], mixed[rid]):
                n = got.shape[0]
                torch.testing.assert_close(got, want[-n:], atol=2e-4, rtol=1e-4)


def test_graphs_are_captured_for_verification_rows(checkpoints: dict[str, Path]) -> None:
    """The decode graphs' largest size holds a step of drafting requests: up to
    `max_batch_size` of them (no drafts with more running), k + 1 rows each."""
    from pagedllm.config import EngineConfig
    from pagedllm.worker.cuda_graphs import capture_sizes, max_decode_rows

    path = str(checkpoints["llama"])
    plain = EngineConfig.create(path, max_num_seqs=16)
    assert max_decode_rows(plain) == 16
    spec = {"num_speculative_tokens": 4, "max_batch_size": 6}
    config = EngineConfig.create(path, max_num_seqs=16, speculative_config=spec)
    assert max_decode_rows(config) == 6 * 5
    assert capture_sizes(max_decode_rows(config))[-1] == 32
    few = EngineConfig.create(path, max_num_seqs=2, speculative_config=spec)
    assert max_decode_rows(few) == 2 * 5
