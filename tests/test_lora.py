"""LoRA adapters against HF + PEFT: a mixed batch (three adapters of different ranks and targets,
and the base model) token-exact with each request's PeftModel greedy, under chunked prefill,
preemption, slot swaps and prefix caching keyed by adapter; log-probs within 1e-4; clear
errors for adapters that cannot run."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import ADAPTERS, chosen_logprobs, peft_model, save_adapter
from test_decode_layers import _generate as one_call_generate
from test_spec_decode import NGRAM, copy_prompts

from conftest import TINY, hf_greedy, make_checkpoint, random_prompts
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.engine.service import EngineService
from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels
from pagedllm.lora.ops import LoraStep, lora_grouped, lora_reference

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen2's q/k/v biases, and a base of its own: the adapters' PeftModels wrap fresh copies
    return make_checkpoint(tmp_path_factory.mktemp("lora") / "base", "qwen2", seed=7)


@pytest.fixture(scope="module")
def adapters(base: Path) -> dict[str, LoRARequest]:
    out = {}
    for i, name in enumerate(ADAPTERS):
        path = save_adapter(base, base.parent / name, name, seed=10 + i)
        out[name] = LoRARequest(name, i + 1, str(path))
    return out


@pytest.fixture(scope="module")
def oracles(base: Path, adapters: dict[str, LoRARequest]) -> dict[str | None, Any]:
    models: dict[str | None, Any] = {None: peft_model(base, None)}
    for name, request in adapters.items():
        models[name] = peft_model(base, Path(request.lora_path))
    return models


def expected(
    oracles: dict, prompts: list[list[int]], names: list[str | None], max_new: int = MAX_NEW
) -> list[list[int]]:
    return [
        hf_greedy(oracles[n], [p], max_new, eos=None)[0]
        for p, n in zip(prompts, names, strict=True)
    ]


def generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[Any]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras
    )
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0
    return outs


def mixed(adapters: dict[str, LoRARequest], n: int) -> tuple[list[str | None], list[Any]]:
    cycle: list[str | None] = ["qv", "all", None, "mlp_o"]
    names = [cycle[i % len(cycle)] for i in range(n)]
    return names, [None if name is None else adapters[name] for name in names]


def test_adapters_change_the_output(oracles: dict) -> None:
    """The oracle itself: each adapter's greedy tokens differ from the base model's (else the
    tests below could not tell an adapter was applied)."""
    prompt = random_prompts(1, (12, 12), TINY["vocab_size"], seed=1)
    plain = hf_greedy(oracles[None], prompt, MAX_NEW, eos=None)
    for name in ADAPTERS:
        assert hf_greedy(oracles[name], prompt, MAX_NEW, eos=None) != plain, name


def test_mixed_batch_with_slot_swaps(base: Path, adapters: dict, oracles: dict) -> None:
    """Three adapters and the base model in one batch, two slots: requests wait for a slot
    (the least recently used adapter is swapped out), none fails; the host cache holds two."""
    names, loras = mixed(adapters, 12)
    prompts = random_prompts(12, (3, 40), TINY["vocab_size"], seed=2)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, loras)]
    assert got == expected(oracles, prompts, names)
    assert llm.engine.runner.lora_table is not None
    assert llm.engine.runner.lora_table.num_loads > 3  # adapters were swapped in and out


def test_one_adapter_for_every_prompt(base: Path, adapters: dict, oracles: dict) -> None:
    prompts = random_prompts(3, (5, 30), TINY["vocab_size"], seed=3)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, False, adapters["all"])
    assert [o.outputs[0].token_ids for o in outs] == expected(oracles, prompts, ["all"] * 3)


def test_chunked_prefill_and_preemption(base: Path, adapters: dict, oracles: dict) -> None:
    names, loras = mixed(adapters, 8)
    prompts = random_prompts(8, (20, 50), TINY["vocab_size"], seed=4)
    # 13-token chunks; a pool of 30 blocks of 4 tokens: requests are preempted
    small: dict[str, Any] = dict(max_num_batched_tokens=13, block_size=4, num_kv_blocks=30)
    llm = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=8, **small)
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, loras)]
    assert llm.engine.stats().num_preemptions > 0
    assert got == expected(oracles, prompts, names)


def test_speculative_decoding_with_adapters(base: Path, adapters: dict, oracles: dict) -> None:
    """n-gram speculation on a mixed batch of adapters: every verified row runs its request's
    adapter, so each request's tokens are still its PeftModel's greedy ones."""
    names, loras = mixed(adapters, 8)
    prompts = copy_prompts(8, seed=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = dict(NGRAM, max_batch_size=8)  # drafting at this batch size too
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, speculative_config=spec)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    llm.engine.check_integrity()
    assert [o.outputs[0].token_ids for o in outs] == expected(oracles, prompts, names, 24)
    assert llm.engine.scheduler.spec is not None
    assert llm.engine.scheduler.spec.num_accepted_tokens > 10  # drafts were verified and kept


def test_prefix_cache_keyed_by_adapter(base: Path, adapters: dict, oracles: dict) -> None:
    prompt = random_prompts(1, (33, 33), TINY["vocab_size"], seed=5)[0]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8)
    first = generate(llm, [prompt], [adapters["qv"]])[0]
    assert first.num_cached_tokens == 0
    names: list[str | None] = ["qv", "all", None]
    outs = generate(llm, [prompt] * 3, [adapters["qv"], adapters["all"], None])
    # the same adapter finds its 4 full blocks; another adapter or the base model none
    assert [o.num_cached_tokens for o in outs] == [32, 0, 0]
    got = [o.outputs[0].token_ids for o in [first, *outs]]
    assert got == expected(oracles, [prompt] * 4, ["qv", *names])


def test_logprobs_match_peft(base: Path, adapters: dict, oracles: dict) -> None:
    names, loras = mixed(adapters, 4)
    prompts = random_prompts(4, (4, 20), TINY["vocab_size"], seed=6)
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    for out, prompt, name in zip(outs, prompts, names, strict=True):
        sample = out.outputs[0]
        assert sample.logprobs is not None
        got = [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
        want = chosen_logprobs(oracles[name], prompt, sample.token_ids)
        assert got == pytest.approx(want, abs=1e-4)


def test_engine_service(base: Path, adapters: dict, oracles: dict) -> None:
    """The served engine's thread: an adapter per submitted request, an unknown folder
    refused through the request's own error callback while the others run."""
    names, loras = mixed(adapters, 4)
    prompts = random_prompts(4, (3, 20), TINY["vocab_size"], seed=9)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8)
    service = EngineService(llm.engine).start()
    done: dict[str, list[Any]] = {}
    errors: dict[str, Exception] = {}
    finished = threading.Semaphore(0)

    def submit(key: str, prompt: list[int], lora: LoRARequest | None) -> None:
        def on_output(out: Any) -> None:
            if out.finished:
                done[key] = out.outputs[0].token_ids
                finished.release()

        def on_error(e: Exception) -> None:
            errors[key] = e
            finished.release()

        service.submit(key, prompt, GREEDY, on_output, on_error, lora_request=lora)

    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        submit(str(i), prompt, lora)
    submit("bad", prompts[0], LoRARequest("gone", 99, "/nowhere"))
    for _ in range(len(prompts) + 1):
        assert finished.acquire(timeout=120)
    service.shutdown()
    assert "no adapter_config.json" in str(errors.pop("bad")) and not errors
    assert [done[str(i)] for i in range(4)] == expected(oracles, prompts, names)
    llm.engine.check_integrity()


def test_two_ranks(base: Path, adapters: dict, oracles: dict) -> None:
    """Tensor parallelism: each rank holds B's rows of its column-parallel layers (q/k/v,
    gate/up) and A's columns of its row-parallel ones (o, down); PEFT's tokens."""
    names, loras = mixed(adapters, 6)
    prompts = random_prompts(6, (3, 30), TINY["vocab_size"], seed=8)
    with LLM(
        str(base), enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=2
    ) as llm:
        got = [o.outputs[0].token_ids for o in generate(llm, prompts, loras)]
    assert got == expected(oracles, prompts, names)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_decode(
    base: Path, adapters: dict, oracles: dict, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps with adapters run the layers in csrc/decoder.cpp's one call (every row
    count): PEFT's tokens (fp32), and the same tokens and log-probs as op by op."""
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS))
    module = cpu_kernels.kernel_module()
    real, with_lora = module.decode_layers, list[bool]()

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        with_lora.append(bool(args[-3]))  # given a LoRA
        return real(x, *args)

    monkeypatch.setattr(module, "decode_layers", counted)
    names, loras = mixed(adapters, 6)
    prompts = random_prompts(6, (3, 30), TINY["vocab_size"], seed=10)
    knobs: dict[str, Any] = dict(max_num_seqs=4, enable_prefix_caching=False, dtype=dtype)
    llm = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=8, **knobs)
    fused = one_call_generate(llm, prompts, loras)
    assert any(with_lora), "no step with an adapter went through decode_layers"
    llm.engine.runner.model._kernel_weights = []
    with_lora.clear()
    assert one_call_generate(llm, prompts, loras) == fused and not with_lora
    if dtype == "float32":
        want = expected(oracles, prompts, names, max_new=20)  # one_call_generate's 20 tokens
        assert [tokens for tokens, _ in fused] == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_deltas_equal_the_reference(dtype: torch.dtype) -> None:
    """The C++ kernel (tokens grouped by slot in C++) and the grouped torch path (contiguous
    runs and gathers) against each token alone."""
    gen = torch.Generator().manual_seed(0)
    slots, rank, d_in, d_out = 3, 6, 40, 72
    a = torch.randn(slots, rank, d_in, generator=gen).to(dtype)
    b = torch.randn(slots, d_out, rank, generator=gen).to(dtype)
    token_slots = [2, 2, -1, 0, 2, 1, 1, 1, -1, 0]
    x = torch.randn(len(token_slots), d_in, generator=gen).to(dtype)
    step = LoraStep.create([{"o": (a, b)}], token_slots, {"o": [True] * slots}, x.device)
    assert step.kernel is not None
    want = lora_reference(x, a, b, torch.tensor(token_slots))
    tol = 1e-5 if dtype == torch.float32 else 0.1
    grouped, kernel = (
        torch.zeros(len(token_slots), d_out, dtype=dtype),
        torch.zeros(len(token_slots), d_out, dtype=dtype),
    )
    lora_grouped(grouped, x, a, b, step.groups)
    step.add(0, "o", x, kernel)
    for out in (grouped, kernel):
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
        assert out[2].abs().sum() == 0 and out[8].abs().sum() == 0  # base-model tokens


# --- errors ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_llm(base: Path) -> LLM:
    return LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=4)


def test_rank_above_max(lora_llm: LLM, adapters: dict) -> None:
    with pytest.raises(ValueError, match=r"adapter 'all' has rank 8, above max_lora_rank 4"):
        lora_llm.generate("hi", GREEDY, use_tqdm=False, lora_request=adapters["all"])
    lora_llm.engine.check_integrity()
    assert not lora_llm.engine.has_unfinished_requests()


def test_malformed_folders(lora_llm: LLM, adapters: dict, tmp_path: Path) -> None:
    good = Path(adapters["qv"].lora_path)
    with pytest.raises(ValueError, match=r"adapter 'gone': no adapter_config.json"):
        lora_llm.generate("hi", lora_request=LoRARequest("gone", 9, str(tmp_path / "no")))
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"adapter 'bad': .* is not valid JSON"):
        lora_llm.generate("hi", lora_request=LoRARequest("bad", 10, str(bad)))
    (bad / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=r"adapter 'bad': .* not a valid safetensors file"):
        lora_llm.generate("hi", lora_request=LoRARequest("bad", 11, str(bad)))


def test_target_module_the_model_lacks(lora_llm: LLM, adapters: dict, tmp_path: Path) -> None:
    other = tmp_path / "c_attn"
    shutil.copytree(adapters["qv"].lora_path, other)
    config = json.loads((other / "adapter_config.json").read_text())
    config["target_modules"] = ["c_attn", "q_proj"]
    (other / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"adapter 'x' targets 'c_attn', which the model lacks"):
        lora_llm.generate("hi", lora_request=LoRARequest("x", 12, str(other)))


def test_lora_off(base: Path, adapters: dict) -> None:
    llm = LLM(str(base))
    with pytest.raises(ValueError, match=r"LoRA is not enabled"):
        llm.generate("hi", lora_request=adapters["qv"])
    with pytest.raises(ValueError, match=r"lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/nowhere")
