"""xgrammar against llguidance on SmolLM2's tokenizer, on the CPU; prints one JSON document.

    .venv/bin/python benchmarks/grammar_engines.py [--reps 7] [--walks 5] [--out FILE]

Per engine (medians, ms): tokenizer setup; compile of a JSON schema, a regex, a GBNF grammar and
"any JSON object", cold and cached (llguidance has no cache: a new `LLMatcher` against
`deep_copy()` of a pristine one), and the first mask fill after it; the mask fill per token
while walking a valid document at batch 1 and `--batch`, checking that each token is allowed
and at the end EOS alone; applying a (batch, vocab) bitmask to fp32 logits.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import llguidance as llg
import llguidance.torch as llgt
import numpy as np
import torch
import xgrammar as xgr

VOCAB = 49152
EOS = 2  # <|im_end|>
MODEL = Path.home() / ".cache/pagedllm/models/SmolLM2-135M-Instruct"
# ~8 properties: nested object, array of strings, enum, bounded integer, number, boolean,
# optional string with maxLength; closed objects
SCHEMA = json.loads("""{"type": "object", "additionalProperties": false,
  "required": ["id", "name", "role", "score", "active", "tags", "address"],
  "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 1000000}, "name": {"type": "string"},
    "role": {"enum": ["admin", "editor", "viewer"]}, "score": {"type": "number"},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {"type": "object", "additionalProperties": false, "required": ["street", "city"],
      "properties": {"street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string"}}},
    "nickname": {"type": "string", "maxLength": 16}}}""")
# valid under SCHEMA, 83 SmolLM2 tokens
DOCUMENT = (
    '{"id":18151,"name":"Ada Lovelace","role":"admin","score":97.25,"active":true,'
    '"tags":["mathematics","analytical engine","poetry","notes"],"address":{"street":'
    '"12 St James\'s Square","city":"London","zip":"SW1Y 4JH"},"nickname":"Enchantress"}'
)
REGEX = (
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})"
)
GBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?
"""
ANY_OBJECT = {"type": "object"}
KINDS = ("json_schema", "regex", "gbnf", "any_json_object")


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def allowed_ids(bitmask: torch.Tensor, row: int) -> list[int]:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


class Xgrammar:
    name = "xgrammar"
    batch_api = "xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask / batch_accept_token"

    def __init__(self, model: Path, threads: int) -> None:
        from transformers import AutoTokenizer

        self.hf, self.threads = AutoTokenizer.from_pretrained(str(model)), threads
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.setup()

    def setup(self) -> None:
        info = xgr.TokenizerInfo.from_huggingface(self.hf, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(info, max_threads=self.threads)

    def compile(self, kind: str, cold: bool = True) -> Any:
        if cold:
            self.compiler.clear_cache()
        c = self.compiler
        if kind == "regex":
            return c.compile_regex(REGEX)
        if kind == "gbnf":
            return c.compile_grammar(GBNF)
        return c.compile_json_schema(json.dumps(SCHEMA if kind == "json_schema" else ANY_OBJECT))

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matchers: list[Any], token: int) -> bool:
        if len(matchers) == 1:
            return bool(matchers[0].accept_token(token))
        return all(self.batcher.batch_accept_token(matchers, [token] * len(matchers)))

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class Llguidance:
    name = "llguidance"
    batch_api = "llguidance.torch.fill_next_token_bitmask_par / LLExecutor.consume_token_par"

    def __init__(self, model: Path, threads: int) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.executor = llg.LLExecutor(num_threads=threads)
        self.setup()
        # no compile cache in llguidance: a server would keep pristine matchers and copy them
        self.pristine = {kind: self.compile(kind) for kind in KINDS}

    def setup(self) -> None:
        self.lltok = llg.LLTokenizer(self.tok.to_str(), n_vocab=VOCAB, eos_token=EOS)

    def compile(self, kind: str, cold: bool = True) -> Any:
        if not cold:
            return self.pristine[kind].deep_copy()
        if kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(REGEX)
        elif kind == "gbnf":
            grammar = llg.grammar_from("gbnf", GBNF)
        else:
            schema = SCHEMA if kind == "json_schema" else ANY_OBJECT
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llg.LLMatcher(self.lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            llgt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            rows = [(m, i) for i, m in enumerate(matchers)]
            llgt.fill_next_token_bitmask_par(self.executor, rows, bitmask)

    def consume(self, matchers: list[Any], token: int) -> bool:
        if len(matchers) == 1:
            return bool(matchers[0].consume_token(token))
        return all(self.executor.consume_token_par([(m, token) for m in matchers]))

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped()) and not matcher.is_error()


Engine = Xgrammar | Llguidance


def compile_times(engine: Engine, kind: str, reps: int) -> dict[str, float]:
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)

    def first_fill() -> float:  # what the first decode step of a new grammar waits for
        matcher = engine.matcher(engine.compile(kind))
        start = time.perf_counter()
        engine.fill([matcher], bitmask)
        return time.perf_counter() - start

    engine.compile(kind, cold=False)  # fills xgrammar's cache
    return {
        "cold_ms": median_ms(lambda: engine.compile(kind), reps),
        "cached_ms": median_ms(lambda: engine.compile(kind, cold=False), reps),
        "first_fill_after_cold_ms": round(
            statistics.median(first_fill() for _ in range(reps)) * 1e3, 3
        ),
    }


def walk(engine: Engine, tokens: list[int], batch: int, walks: int) -> dict[str, Any]:
    """Fill, then consume, along `tokens` + EOS with `batch` matchers, `walks` times; the first
    walk (fresh lazy state) is reported apart. Checks each token against every row's mask."""
    compiled = engine.compile("json_schema", cold=False)
    bitmask = torch.zeros(batch, VOCAB // 32, dtype=torch.int32)
    steps: list[list[float]] = [[] for _ in range(len(tokens) + 1)]  # per position, per walk
    consumes: list[float] = []
    refused: set[int] = set()
    end_ok = True
    for _ in range(walks):
        matchers = [engine.matcher(compiled) for _ in range(batch)]
        for pos, token in enumerate([*tokens, EOS]):
            start = time.perf_counter()
            engine.fill(matchers, bitmask)
            mid = time.perf_counter()
            ok = engine.consume(matchers, token)
            consumes.append(time.perf_counter() - mid)
            steps[pos].append(mid - start)
            words = bitmask[:, token // 32].tolist()
            if not ok or not all((w >> (token % 32)) & 1 for w in words):
                refused.add(pos)
            if token == EOS:  # the last mask must allow EOS alone
                end_ok &= all(allowed_ids(bitmask, r) == [EOS] for r in range(batch))
        end_ok &= all(engine.finished(m) for m in matchers)
    ms = sorted(t * 1e3 for s in steps for t in s[1:]) or sorted(s[0] * 1e3 for s in steps)
    slowest = sorted(range(len(steps)), key=lambda p: -statistics.median(steps[p]))[:3]
    return {
        "fill_ms_mean": round(statistics.fmean(ms), 4),
        "fill_ms_p50": round(ms[len(ms) // 2], 4),
        "fill_ms_p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
        "fill_ms_mean_first_walk": round(statistics.fmean(s[0] for s in steps) * 1e3, 4),
        "slowest_positions_ms": {p: round(statistics.median(steps[p]) * 1e3, 3) for p in slowest},
        "consume_ms_mean": round(statistics.fmean(consumes) * 1e3, 4),
        "token_refused_at_positions": sorted(refused),
        "end_only_eos_and_terminated": end_ok,
    }


def mask_diff(engines: list[Engine], tokens: list[int], tok: Any) -> dict[str, Any]:
    """Where the two engines' masks differ along the document (both may be right)."""
    masks: list[list[set[int]]] = []
    for engine in engines:
        matcher = engine.matcher(engine.compile("json_schema", cold=False))
        bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
        masks.append([])
        for token in tokens:
            engine.fill([matcher], bitmask)
            masks[-1].append(set(allowed_ids(bitmask, 0)))
            engine.consume([matcher], token)
    out: dict[str, Any] = {
        "positions": [i for i, (a, b) in enumerate(zip(*masks, strict=True)) if a != b]
    }
    for i, engine in enumerate(engines):
        only = set().union(*(a[i] - a[1 - i] for a in zip(*masks, strict=True)))
        out[f"only_{engine.name}_allows"] = {
            "count": len(only),
            "first": [tok.id_to_token(t) for t in sorted(only)[:20]],
        }
    return out


def unpack_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    logits.masked_fill_(torch.from_numpy(bits[:, : logits.shape[1]]) == 0, float("-inf"))


def apply_times(batch: int, reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (batch, VOCAB // 32), dtype=torch.int32, generator=gen
    )
    logits = torch.randn(batch, VOCAB, generator=gen)
    fns: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        "xgrammar.apply_token_bitmask_inplace": xgr.apply_token_bitmask_inplace,
        "llguidance.torch.apply_token_bitmask_inplace (torch.compile)": llgt.apply_token_bitmask_inplace,
        "numpy unpackbits + masked_fill_ (reference)": unpack_apply,
    }
    out: dict[str, Any] = {"shape": [batch, VOCAB]}
    results = []
    for name, fn in fns.items():
        try:
            first = logits.clone()
            start = time.perf_counter()
            fn(first, bitmask)
            first_ms = round((time.perf_counter() - start) * 1e3, 1)
            results.append(torch.isinf(first))
            call = partial(fn, logits.clone(), bitmask)
            second_ms = median_ms(call, 1)
            median_ms(call, 3)  # warm-up
            out[name] = {"first_call_ms": first_ms, "second_call_ms": second_ms}
            out[name]["ms"] = median_ms(call, max(reps, 20))
        except Exception as e:  # torch.compile on the CPU needs a C++ toolchain
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    out["same_result"] = all(torch.equal(results[0], r) for r in results[1:])
    return out


def wheel_info(dist: str) -> dict[str, Any]:
    d = md.distribution(dist)
    wheel = (d.read_text("WHEEL") or "").splitlines()
    tags = [line.split(":", 1)[1].strip() for line in wheel if line.startswith("Tag:")]
    return {
        "version": d.version,
        "wheel_tags": tags,
        "abi3": any("-abi3-" in t for t in tags),
        "requires_python": d.metadata["Requires-Python"],
        "runtime_requires": [r for r in d.requires or [] if "extra ==" not in r],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="engine worker threads"
    )
    ap.add_argument("--out", default=None, help="also write the JSON there")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    load_before = os.getloadavg()
    model = Path(args.model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokens = tok.encode(DOCUMENT, add_special_tokens=False).ids
    engines: list[Engine] = [Xgrammar(model, args.threads), Llguidance(model, args.threads)]
    out: dict[str, Any] = {
        "model_dir": str(model),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "engine_threads": args.threads,
        "reps": args.reps,
        "walks": args.walks,
        "document_tokens": len(tokens),
        "packages": {d: wheel_info(d) for d in ("xgrammar", "apache-tvm-ffi", "llguidance")},
    }
    for eng in engines:
        out[eng.name] = {
            "tokenizer_setup_ms": median_ms(eng.setup, args.reps),
            "compile": {kind: compile_times(eng, kind, args.reps) for kind in KINDS},
            "batch_api": eng.batch_api,
            "walk_batch_1": walk(eng, tokens, 1, args.walks),
            f"walk_batch_{args.batch}": walk(eng, tokens, args.batch, args.walks),
        }
    out["mask_differences"] = mask_diff(engines, tokens, tok)
    # NOTE: 2-thread kernels on a 2-core box are bimodal (time-slicing); 1 thread is the steady one
    threads = torch.get_num_threads()
    out["apply_bitmask"] = {}
    for n in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n)
        out["apply_bitmask"][f"torch_threads_{n}"] = apply_times(args.batch, args.reps)
    torch.set_num_threads(threads)
    # other processes on the machine: (1, 5, 15)-minute load averages around the run
    out["load_average"] = {"before": load_before, "after": os.getloadavg()}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
