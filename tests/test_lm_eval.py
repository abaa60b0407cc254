"""lm-evaluation-harness against `pagedllm openai` (test_openai's real tritonserver and gateway,
tiny llama fp32): its `local-completions` model sends token-id prompts, scores multiple-choice
continuations by `echo` + `logprobs` and generates with stop strings. Two tasks are defined
from local files (a task YAML and a JSONL each, nothing from a hub); every choice's
log-likelihood equals HF transformers' on the ids lm-eval encodes (1e-3) and each greedy
generation equals HF greedy's text up to the stop string."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_openai
import torch
from test_openai import MODEL

from conftest import hf_greedy, hf_model

model_dir, server, gateway = test_openai.model_dir, test_openai.server, test_openai.gateway

MAX_GEN = 8
# each question's choices; the model's greedy next token is added as a fourth (is_greedy)
CHOICE_DOCS = [
    ("The quick brown fox jumps over the", [" lazy dog.", " city.", " engine"]),
    ("Paged attention stores keys and", [" values", " blocks", " dogs"]),
    ("Once upon a time, in a city", [" far away", " of blocks", " ok"]),
    ("Bonjour, ça va? Très", [" bien", " loin", " 東京"]),
]
GENERATE_DOCS = [
    {"prompt": "Once upon a time", "target": "there"},
    {"prompt": "Continuous batching admits", "target": "new"},
    {"prompt": "Grüße aus", "target": "Köln"},
]
CHOICE_TASK = """\
task: pagedllm_choice
dataset_path: json
dataset_kwargs:
  data_files: {data}
  cache_dir: {cache}
test_split: train
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""
GENERATE_TASK = """\
task: pagedllm_generate
dataset_path: json
dataset_kwargs:
  data_files: {data}
  cache_dir: {cache}
test_split: train
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_task(root: Path, name: str, template: str, docs: list[dict[str, Any]]) -> None:
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    text = template.format(data=data, cache=root / "datasets", max_gen=MAX_GEN)
    (root / f"{name}.yaml").write_text(text)


def greedy_choice(hf: Any, tokenizer: Any, question: str) -> str:
    """The text of the model's most likely next token after `question`."""
    ids = tokenizer(question, add_special_tokens=False).input_ids
    return str(tokenizer.decode(hf_greedy(hf, [ids], 1, eos=None)[0]))


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into ids: trailing spaces of the
    context move to the continuation; the whole is encoded, then cut after the context's ids."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids) :]


def hf_loglikelihood(hf: Any, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context, and whether it is all greedy."""
    ids = context + continuation
    with torch.no_grad():
        rows = hf(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)
    picked = rows[len(context) - 1 : -1]
    target = torch.tensor(continuation)
    total = picked.gather(1, target[:, None]).sum().item()
    return total, bool((picked.argmax(dim=-1) == target).all())


def test_lm_eval_local_completions(
    gateway: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    import transformers
    from lm_eval.tasks import TaskManager

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    hf = hf_model(model_dir)
    docs = [
        {"question": q, "choices": [*choices, greedy_choice(hf, tokenizer, q)]}
        for q, choices in CHOICE_DOCS
    ]
    write_task(tmp_path, "choice", CHOICE_TASK, docs)
    write_task(tmp_path, "generate", GENERATE_TASK, GENERATE_DOCS)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": MODEL,
            "base_url": f"{gateway}/v1/completions",
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",
            "batch_size": 2,  # prompts as a list of token-id lists
            "max_length": 512,
        },
        tasks=["pagedllm_choice", "pagedllm_generate"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert results is not None
    samples = results["samples"]

    scored = greedy = 0
    for sample in samples["pagedllm_choice"]:
        assert len(sample["arguments"]) == 4
        for (context, continuation), resps in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            ll, is_greedy = resps[0]
            expected, expected_greedy = hf_loglikelihood(
                hf, *encode_pair(tokenizer, context, continuation)
            )
            assert ll == pytest.approx(expected, abs=1e-3), (context, continuation)
            assert is_greedy == expected_greedy, (context, continuation)
            scored, greedy = scored + 1, greedy + is_greedy
    assert scored == 4 * len(CHOICE_DOCS)
    assert greedy >= 2  # the greedy choices that encode as the one token

    generated = samples["pagedllm_generate"]
    assert len(generated) == len(GENERATE_DOCS)
    for sample in generated:
        context = sample["arguments"][0][0]
        ids = tokenizer(context, add_special_tokens=False).input_ids
        out = hf_greedy(hf, [ids], MAX_GEN, eos=tokenizer.eos_token_id)[0]
        expected = tokenizer.decode(out, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == expected, context
