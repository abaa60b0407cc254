"""Structured outputs in the engine (tiny random Llama, fp32), against independent oracles:
greedy constrained runs equal HF transformers' logits masked step by step by a matcher built
straight from llguidance (token-exact, log-probs to 1e-4); sampled outputs validate with
`jsonschema`, `re.fullmatch` or choice membership; constrained and unconstrained requests
share batches with chunked prefill, prefix-cache hits and preemptions and lose nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
import torch

from conftest import hf_model
from pagedllm import LLM, SamplingParams
from pagedllm.structured.params import StructuredOutputsParams

EOS = 1  # the tiny checkpoint's
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["fox", "dog", "engineer"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["id", "kind", "ok"],
    "additionalProperties": False,
}
# constraints that end on a random model (bounded strings, no free whitespace)
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "regex": {"regex": r"(quick|lazy) [a-z]{1,6} [0-9]{2,4}"},
    "choice": {"choice": ["The quick brown fox", "Bonjour", "Paged attention"]},
    "lark": {"grammar": 'start: "city" " " NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'},
    "gbnf": {"grammar": 'root ::= "curious " ("engineer" | "dog") "!"'},
}
PROMPT = "Once upon a time, in a city far away,"


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(CONSTRAINTS["regex"]["regex"], text) is not None
    if kind == "choice":
        return text in CONSTRAINTS["choice"]["choice"]
    if kind == "lark":
        return re.fullmatch(r"city [0-9]{1,3}(,[0-9]{1,3})*", text) is not None
    return text in ("curious engineer!", "curious dog!")


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path]) -> LLM:
    return LLM(str(checkpoints["llama"]), dtype="float32")


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> Any:
    return hf_model(checkpoints["llama"])


def reference(
    ckpt: Path, oracle: Any, prompt: list[int], spec: dict[str, Any], max_new: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step masked log_softmax rows: HF logits over the whole sequence,
    masked by an llguidance matcher built here from the tokenizer file (not pagedllm's)."""
    tok = llguidance.LLTokenizer((ckpt / "tokenizer.json").read_text(), n_vocab=384, eos_token=EOS)
    if "json" in spec:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            spec["json"], defaults={"whitespace_flexible": False}
        )
    elif "choice" in spec:
        grammar = llguidance.grammar_from("choice", json.dumps(spec["choice"]))
    else:
        grammar = llguidance.grammar_from(
            "regex" if "regex" in spec else "grammar", spec.get("regex") or spec["grammar"]
        )
    matcher = llguidance.LLMatcher(tok, grammar)
    ids, out, rows = list(prompt), [], []
    for _ in range(max_new):
        with torch.no_grad():
            logits = oracle(torch.tensor([ids])).logits[0, -1].double()
        mask = matcher.compute_bitmask()  # little-endian 32-bit words, bit t % 32 of word t // 32
        allowed = torch.tensor([(mask[t // 8] >> (t % 8)) & 1 for t in range(384)])
        logits = logits.masked_fill(allowed == 0, float("-inf"))
        rows.append(logits.log_softmax(dim=-1))
        token = int(logits.argmax())
        out.append(token)
        if token == EOS:
            break
        assert matcher.consume_token(token)
        ids.append(token)
    return out, rows


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_equals_masked_hf_reference(
    kind: str, llm: LLM, oracle: Any, checkpoints: dict[str, Path]
) -> None:
    prompt = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(
        temperature=0, max_tokens=48, logprobs=2, structured_outputs=CONSTRAINTS[kind]
    )
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    got = out.outputs[0]
    want, rows = reference(checkpoints["llama"], oracle, prompt, CONSTRAINTS[kind], 48)
    assert got.token_ids == want
    assert got.finish_reason == "stop" and valid(kind, got.text), got.text
    # log-probs are of the masked distribution (vLLM's): the grammar's tokens renormalized
    assert got.logprobs is not None
    for token, entry, ref in zip(got.token_ids, got.logprobs, rows, strict=True):
        assert abs(entry[token].logprob - ref[token].item()) < 1e-4
        for tid, lp in entry.items():  # a banned alternative: -inf, as in vLLM
            assert lp.logprob == ref[tid].item() == float("-inf") or (
                abs(lp.logprob - ref[tid].item()) < 1e-4
            )


def test_mixed_batch_with_chunks_prefix_hits_and_preemption(checkpoints: dict[str, Path]) -> None:
    """Constrained and free requests in one batch through a tiny KV pool and token budget
    give what each gives alone on a roomy engine."""
    ckpt = str(checkpoints["llama"])
    roomy = LLM(ckpt, dtype="float32")
    tight = LLM(ckpt, dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)
    tok = roomy.get_tokenizer()
    prefix = tok.encode("Paged attention stores keys and values in fixed-size blocks. " * 2)
    prompts, params = [], []
    for i, kind in enumerate([*CONSTRAINTS, None, None, *CONSTRAINTS]):
        prompts.append({"prompt_token_ids": prefix + tok.encode(f" request {i}:")})
        so = None if kind is None else CONSTRAINTS[kind]
        params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs=so))
    alone = [roomy.generate(p, s, use_tqdm=False)[0] for p, s in zip(prompts, params, strict=True)]
    together = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for a, b in zip(alone, together, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_outputs_match_and_seeds_repeat(kind: str, llm: LLM) -> None:
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=64, structured_outputs=CONSTRAINTS[kind]
    )
    first, again = (llm.generate(PROMPT, params, use_tqdm=False)[0] for _ in range(2))
    for c in first.outputs:
        assert c.finish_reason == "stop" and valid(kind, c.text), c.text
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_max_tokens_cuts_a_document_with_length(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs=CONSTRAINTS["json"])
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.outputs[0].text)


def test_grammar_end_wins_over_min_tokens_and_ignore_eos(llm: LLM) -> None:
    so = {"choice": ["Bonjour"]}
    for extra in ({"min_tokens": 20}, {"ignore_eos": True}):
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=so, **extra)
        (out,) = llm.generate(PROMPT, params, use_tqdm=False)
        assert out.outputs[0].text == "Bonjour" and out.outputs[0].finish_reason == "stop"
    # before the grammar can end, min_tokens still holds EOS back
    so = {"regex": "[a-z]{1,12}"}
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=6, structured_outputs=so)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 6 and re.fullmatch("[a-z]{1,12}", out.outputs[0].text)


def test_stop_string_inside_a_constrained_output(llm: LLM) -> None:
    so = {"choice": ["The quick brown fox"]}
    params = SamplingParams(temperature=0, max_tokens=30, stop=["brown"], structured_outputs=so)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert out.outputs[0].text == "The quick " and out.outputs[0].stop_reason == "brown"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"regex": "a(b"}, "invalid regex constraint: .*unclosed group"),
        ({"json": {"type": "nope"}}, "invalid json constraint: .*nope"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"grammar": "root ::= ("}, "invalid grammar constraint"),
        ({"grammar": "start: missing"}, "invalid grammar constraint: .*missing"),
        ({"choice": []}, "choice must be a list"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of .*got regex, choice"),
        ({}, "exactly one of .*none given"),
        ({"jsn": {}}, "unknown structured_outputs keys: jsn"),
        ({"json_object": "false", "regex": "a"}, None),  # a string flag, read as a boolean
        ({"json_object": "maybe"}, "json_object must be a boolean"),
        ({"structural_tag": {"structures": [], "triggers": ["<x>"]}}, "at least one structure"),
    ],
)
def test_constraints_are_checked_before_queueing(
    spec: dict[str, Any], message: str | None, llm: LLM
) -> None:
    if message is None:
        out = llm.generate(PROMPT, SamplingParams(structured_outputs=spec), use_tqdm=False)
        assert out[0].outputs[0].text == "a"
        return
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_structural_tag_constrains_only_after_its_trigger(llm: LLM) -> None:
    from pagedllm.structured.grammar import GrammarCompiler

    compiler = llm.engine.grammar_compiler()
    assert isinstance(compiler, GrammarCompiler)
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f=go>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f="],
    }
    spec = StructuredOutputsParams(structural_tag=tag)
    tok = llm.get_tokenizer()

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(spec)
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False))

    assert accepts('free text <f=go>{"id": 3, "kind": "dog", "ok": true}</f> more')
    assert not accepts('text <f=go>{"id": 300, "kind": "dog", "ok": true}</f>')
    assert not accepts("text <f=stop>")


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler()
    spec = StructuredOutputsParams(regex="[0-9]{5}")
    before = (compiler.hits, compiler.misses)
    first, second = (
        compiler.compile(spec),
        compiler.compile(StructuredOutputsParams(regex="[0-9]{5}")),
    )
    assert first is second
    assert (compiler.hits, compiler.misses) == (before[0] + 1, before[1] + 1)


def test_bad_words_cannot_empty_a_grammar(checkpoints: dict[str, Path]) -> None:
    """Bad words ban inside the grammar's mask, which they must not empty: two such
    requests at once neither fail nor poison the engine."""
    llm = LLM(str(checkpoints["llama"]), dtype="float32")
    so = {"choice": ["Bonjour", "Paged attention"]}
    params = SamplingParams(
        temperature=0, max_tokens=20, bad_words=["Bonjour"], structured_outputs=so
    )
    outs = llm.generate([PROMPT, PROMPT + " again"], params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text in so["choice"]
    assert llm.engine.dead_reason is None and not llm.engine.request_errors
    # a ban of the grammar's only way on is overruled
    only = SamplingParams(
        temperature=0,
        max_tokens=20,
        bad_words=["Bonjour"],
        structured_outputs={"choice": ["Bonjour"]},
    )
    (out,) = llm.generate(PROMPT, only, use_tqdm=False)
    assert out.outputs[0].text == "Bonjour" and out.outputs[0].finish_reason == "stop"


def test_a_grammar_past_the_engines_limits_fails_alone(checkpoints: dict[str, Path]) -> None:
    """A schema whose parser outgrows llguidance's limits after its first token: that
    request is aborted with an error naming the limit; a request beside it goes on."""
    llm = LLM(str(checkpoints["llama"]), dtype="float32")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.engine.add_request(
        "wide", PROMPT, SamplingParams(max_tokens=8, structured_outputs={"json": wide})
    )
    llm.engine.add_request("free", PROMPT, greedy)
    finished = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["wide"].outputs[0].finish_reason == "abort"
    assert "max is 2000" in str(llm.engine.request_errors["wide"])
    assert finished["free"].outputs[0].finish_reason == "length"
    assert len(finished["free"].outputs[0].token_ids) == 8
    assert llm.engine.dead_reason is None


def test_ignore_eos_does_not_skip_min_tokens_under_a_grammar(llm: LLM) -> None:
    so = {"regex": "[a-z]{1,12}"}
    params = SamplingParams(
        temperature=0, max_tokens=30, min_tokens=6, ignore_eos=True, structured_outputs=so
    )
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 6 and re.fullmatch("[a-z]{1,12}", out.outputs[0].text)


DEEP_CHAIN = r"""
import sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32")
chain = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(4000)) + '\nr4000: "c"'
refs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
refs["d3000"] = {"type": "integer", "minimum": 0, "maximum": 9}
schema = {"$defs": refs, "$ref": "#/$defs/d0"}
for so in ({"grammar": chain}, {"json": schema}):
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=4, structured_outputs=so))
    print(repr(out[0].outputs[0].text))
"""


def test_long_rule_chains_compile_without_crashing(checkpoints: dict[str, Path]) -> None:
    """llguidance's compiler recurses per link of a rule or $ref chain: thousands overflow a
    thread's default stack (SIGSEGV, the whole server). Compiles run on a big stack; here in
    a child process, so a regression fails this test rather than the test run."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", DEEP_CHAIN, str(checkpoints["llama"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split()
    assert lines[0] == "'c'" and re.fullmatch(r"'[0-9]'", lines[1])


def test_deep_schemas_are_refused_by_depth(llm: LLM) -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    for so in (
        {"json": deep, "disable_additional_properties": True},
        {"json": json.dumps(deep)},
    ):
        with pytest.raises(ValueError, match="json is nested too deeply"):
            llm.generate(PROMPT, SamplingParams(structured_outputs=so), use_tqdm=False)


def test_the_cache_is_bounded_by_size(checkpoints: dict[str, Path]) -> None:
    from pagedllm.structured.grammar import GrammarCompiler
    from pagedllm.text import Tokenizer

    tok = Tokenizer.from_model_dir(checkpoints["llama"])
    compiler = GrammarCompiler(tok.to_json(), 384, [EOS], cache_size=100, cache_chars=200)
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{i}}}" + "x" * 40) for i in range(1, 9)]
    for spec in specs:
        compiler.compile(spec)
    assert 1 <= len(compiler._cache) <= 4  # 200 characters of keys of ~60
    compiler.compile(specs[-1])
    assert compiler.hits == 1
