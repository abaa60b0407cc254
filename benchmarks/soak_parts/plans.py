"""What the soak asks: prompt specs, one request's plan drawn from the protocol mix (MIX), how
a client sees its end (Reply), and a plan written as Triton inputs or a gateway body."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from pagedllm.text.tokenizer import Tokenizer

from .bad_inputs import BAD_REQUESTS, gateway_json, spoil_triton_values

LONG = 160  # max_tokens of requests that are cancelled: still running when the cancel comes
PROMPTS = [
    "Once upon a time,",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain paged attention in one sentence.",
    "Grüße aus Köln! 東京は晴れです。 Translate this.",
]
WORDS = (  # noqa: SIM905
    "time river light stone garden window morning silver paper engine market winter forest "
    "signal harbor letter mountain bridge candle violet thunder orchard lantern meadow canyon "
    "pocket ribbon castle feather compass marble needle planet rocket saddle tunnel velvet"
).split()
# protocol: (weight of good requests, of cancels): a good request is greedy 3 times in 4;
# http_generate's cancels are disconnects (not cancelled upstream, see soak.py's docstring)
MIX = {
    "http_generate": (10, 1),
    "http_generate_stream": (8, 3),
    "http_infer_llm": (8, 0),
    "grpc_infer_llm": (8, 3),
    "grpc_stream": (10, 3),
    "grpc_stream_nonstreamed": (6, 2),
    "openai_completions": (5, 1),
    "openai_completions_stream": (5, 2),
    "openai_chat": (5, 1),
    "openai_chat_stream": (5, 2),
}
BAD_WEIGHT = 12
STREAMED_OPENAI = ("openai_completions_stream", "openai_chat_stream")


@dataclass(frozen=True)
class Spec:
    """A prompt and its parameters (greedy requests with it are checked against the oracle)."""

    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """One request of the soak. `kind`: good, cancel (mid-stream, or a gRPC deadline / closed
    connection while waiting), disconnect (HTTP non-streamed: not cancelled upstream) or bad."""

    protocol: str
    kind: str
    spec: Spec
    greedy: bool = True
    bad: str = ""  # the BAD_REQUESTS case
    cancel_after: int = 0  # responses (streams) before the cancel
    cancel_seconds: float = 0.0  # seconds before a disconnect (non-streamed)
    seed: int = 0
    echo: bool = False  # the prompt first in a non-streamed Triton text (the default there)

    def sampling(self) -> dict[str, Any]:
        """vLLM-named parameters (the JSON object Triton gets; the gateway's fields)."""
        params: dict[str, Any] = {"ignore_eos": True}
        if self.greedy:
            params["temperature"] = 0
        else:
            params.update(temperature=0.8, top_p=0.95, seed=self.seed)
        if self.spec.stop:
            params["stop"] = list(self.spec.stop)
        return params

    def max_tokens(self) -> int:
        return LONG if self.kind == "cancel" else self.spec.max_tokens


@dataclass
class Reply:
    """How a request ended, as the client saw it. `end`: final (its last response arrived),
    error (an error answer), cancelled (the client cancelled or left, as planned), timeout (no
    end within the request timeout), truncated (the answer ended without its final part)."""

    end: str
    text: str = ""
    finish_reason: str = ""
    status: int | None = None  # HTTP status
    code: str = ""  # gRPC status code name; "" for an error on a stream
    message: str = ""

    @classmethod
    def broken(cls, e: Exception) -> Reply:
        """A broken answer (connection closed, bad JSON, missing field): the server's fault."""
        return cls("truncated", message=f"{type(e).__name__}: {e}")


def make_specs(tokenizer: Tokenizer, context: int, count: int, rng: random.Random) -> list[Spec]:
    """`count` specs: the PROMPTS, then prompts of random words of 32 to 256 tokens (shorter for
    a small context); max_tokens 8 to 48, stop strings on some."""
    longest = max(8, min(256, context - LONG - 16))
    prompts = list(PROMPTS)
    while len(prompts) < count:
        target = rng.randint(min(32, longest), longest)
        words = [rng.choice(WORDS).capitalize()]
        while len(tokenizer.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words))
    specs = []
    for i, prompt in enumerate(prompts[:count]):
        stop = ((".",), ("\n",), ())[i % 3] if i % 2 else ()
        specs.append(Spec(prompt, rng.choice([8, 16, 24, 32, 48]), stop))
    return specs


def pick(rng: random.Random, specs: list[Spec]) -> Plan:
    """A random plan: a protocol and good / cancel by MIX's weights, or a BAD_REQUESTS case."""
    choices = [(p, "good") for p in MIX] + [(p, "cancel") for p in MIX] + [("", "bad")]
    weights = [g for g, _ in MIX.values()] + [c for _, c in MIX.values()] + [BAD_WEIGHT]
    protocol, kind = rng.choices(choices, weights)[0]
    spec = rng.choice(specs)
    if kind == "bad":
        protocol, bad = rng.choice([(p, b) for p, cases in BAD_REQUESTS.items() for b in cases])
        return Plan(protocol, kind, spec, bad=bad)
    if kind == "cancel" and protocol == "http_generate":
        kind = "disconnect"
    streamed = protocol in ("grpc_stream", "http_generate_stream", *STREAMED_OPENAI)
    return Plan(
        protocol,
        kind,
        spec,
        greedy=kind != "good" or rng.random() < 0.75,
        cancel_after=rng.randint(1, 8) if kind == "cancel" and streamed else 0,
        cancel_seconds=rng.uniform(0.2, 1.5),
        seed=rng.randrange(1 << 31),
        echo=rng.random() < 0.5,
    )


def triton_values(plan: Plan, stream: bool) -> dict[str, Any]:
    """The request's inputs (name -> value), with BAD_REQUESTS' change applied."""
    values: dict[str, Any] = {
        "text_input": plan.spec.prompt,
        "max_tokens": plan.max_tokens(),
        "sampling_parameters": json.dumps(plan.sampling()),
        "stream": stream,
        # a non-streamed text starts with the prompt unless excluded
        "exclude_input_in_output": stream or not plan.echo,
    }
    spoil_triton_values(values, plan.bad)
    return values


def triton_datatype(value: Any) -> str:
    """The Triton datatype of an input's value."""
    return "BYTES" if isinstance(value, str) else "BOOL" if isinstance(value, bool) else "INT32"


def gateway_body(plan: Plan, model: str, chat: bool, stream: bool) -> bytes:
    """The JSON body of a /v1/completions or /v1/chat/completions request."""
    body: dict[str, Any] = {"model": model, "stream": stream, **plan.sampling()}
    if chat:
        body.update(
            messages=[{"role": "user", "content": plan.spec.prompt}],
            max_completion_tokens=plan.max_tokens(),
        )
    else:
        body.update(prompt=plan.spec.prompt, max_tokens=plan.max_tokens())
    return gateway_json(body, plan.bad, chat)
