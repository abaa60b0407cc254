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
from pagedllm.lora import LoRAConfig, LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling.engine import PoolingEngine
from pagedllm.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput
from pagedllm.pooling.params import PoolerConfig, PoolingParams
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
    steps without CUDA graphs). `num_state_slots`: a hybrid model's (Qwen3.5) requests that
    hold a linear-attention state at once (None: `max_num_seqs`, as memory allows).
    `runner="pooling"` (with `pooler_config`): the model as an embedder, for `embed` alone
    (`pagedllm.pooling`, docs/embeddings.md). `kv_cache_dtype`: vLLM's values, auto (the
    model's dtype), int8 / int8_per_token_head (the CPU) or fp8 / fp8_e4m3 / fp8_e5m2
    (docs/kv_cache.md); an fp8 cache's scales come from the checkpoint, else 1.0, or with
    `calculate_kv_scales` from the first forward's keys and values. `enable_lora`: serve
    LoRA adapters (`generate`'s `lora_request`): `max_loras` at once on the device, ranks up
    to `max_lora_rank`, `max_cpu_loras` kept read in host memory (docs/lora.md). `speculative_config`: vLLM's, e.g. `{"method":
    "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}` (`pagedllm.spec_config`)."""

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
        num_state_slots: int | None = None,
        runner: str = "generate",
        pooler_config: PoolerConfig | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        speculative_config: dict[str, Any] | None = None,
    ) -> None:
        if runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {runner!r}")
        lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
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
            num_state_slots=num_state_slots,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
            lora=lora,
            speculative_config=speculative_config,
        )
        self.pooling = PoolingEngine(config, pooler_config) if runner == "pooling" else None
        self._engine = LLMEngine(config) if self.pooling is None else None
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise ValueError("this LLM runs the pooling runner: generation needs runner='generate'")
        return self._engine

    def close(self) -> None:
        """Release the engine: its tensor-parallel workers stop."""
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer if self.pooling is None else self.pooling.tokenizer

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed` (runner="pooling"): one vector per prompt, in order. A prompt
        that cannot run raises ValueError before anything runs."""
        if self.pooling is None:
            raise ValueError("LLM.embed needs runner='pooling'")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = pooling_params or PoolingParams()
        each = [params] * len(prompts) if isinstance(params, PoolingParams) else list(params)
        if len(each) != len(prompts):
            raise ValueError(f"got {len(each)} pooling params for {len(prompts)} prompts")
        ready = [
            self.pooling.prepare(_prompt_input(p), q) for p, q in zip(prompts, each, strict=True)
        ]
        vectors = self.pooling.embed(ready)
        return [
            EmbeddingRequestOutput(str(next(self._ids)), EmbeddingOutput(v.tolist()), r.token_ids)
            for r, v in zip(ready, vectors, strict=True)
        ]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt that cannot run raises ValueError
        before anything is generated. `lora_request`: one adapter for every prompt, or one
        per prompt (None: the base model)."""
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
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = self._add_all(prompts, params, loras)
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

    def _add_all(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
    ) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                request_id = str(next(self._ids))
                final_only = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                prompt_input = _prompt_input(prompt)
                self.engine.add_request(request_id, prompt_input, final_only, lora_request=lora)
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
