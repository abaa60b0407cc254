"""The offline API, as vLLM's: `LLM(model_dir).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, TypedDict

import torch
from tqdm import tqdm

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | TokensPrompt


class LLM:
    """Generate for a batch of prompts with continuous batching over a paged KV cache.
    `device`: "auto" (a CUDA device when torch sees one, else the CPU), "cpu", "cuda" or
    "cuda:N" (`pagedllm.config.resolve_device`). `quantization`: weight-only, None (the
    checkpoint's weights in `dtype`), "int8" (per output channel), "int4" (affine, groups of
    32) or "gguf" (the model directory's GGUF file, Q8_0 / Q4_0 / Q4_1 kept as they are).
    `tensor_parallel_size`: ranks the model is split over (worker processes; `close()` stops
    them, as does this process's exit). On a GPU, as vLLM's: `gpu_memory_utilization`, the
    share of the device this engine may use (its KV pool takes what the weights and
    activations leave; `kv_cache_memory` is the CPU's budget), and `enforce_eager` (decode
    steps without CUDA graphs). `speculative_config`: vLLM's, e.g. `{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4}` (`pagedllm.spec_config`)."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_cache_memory: int = 2 << 30,
        device: str = "auto",
        attention_backend: str = "auto",
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        speculative_config: dict[str, Any] | None = None,
    ) -> None:
        config = EngineConfig.create(
            model,
            dtype=dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            kv_cache_memory=kv_cache_memory,
            device=device,
            attention_backend=attention_backend,
            quantization=quantization,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            speculative_config=speculative_config,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine: its tensor-parallel workers stop."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt that cannot run raises ValueError
        before anything is generated."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = self._add_all(prompts, params)
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one output per prompt, its `beam_width` sequences best
        first (`pagedllm.beam_search`). The prompts' beam groups run side by side, their
        beams sharing KV blocks; a prompt that cannot run raises ValueError first."""
        ids: list[str] = []
        try:
            for prompt in prompts:
                ids.append(str(next(self._ids)))
                self.engine.add_beam_search(ids[-1], _prompt_input(prompt), params)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        results: dict[str, BeamSearchOutput] = {}
        with tqdm(total=len(ids), desc="Beam search", disable=not use_tqdm or None) as bar:
            while self.engine.has_unfinished_requests():
                self.engine.step()
                for request_id, out in self.engine.take_beam_search_outputs():
                    results[request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                final_only = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, _prompt_input(prompt), final_only)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or None) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {prompt!r}")
