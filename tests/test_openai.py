"""`pagedllm openai`, the OpenAI-compatible gateway, in front of a real tritonserver (tiny llama
checkpoint, fp32), queried with the official `openai` package, httpx and the README's curl
commands. The oracle is the offline `LLM` API on the same checkpoint; for chat, on the prompt
the chat template renders."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_metrics import test_gateway_serves_what_the_endpoint_picker_reads  # noqa: F401
from openai_gateway import MODEL, PROMPT
from server_metrics import metrics, wait_idle
from test_server import offline_text

from pagedllm import LLM, SamplingParams
from pagedllm.openai.chat import ChatTemplate
from pagedllm.serving.tritonserver import TritonServer
from pagedllm.text.tokenizer import Tokenizer

MAX_TOKENS = 12
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about paged attention."},
]
README = Path(__file__).resolve().parents[1] / "README.md"


# The session's checkpoint, server and gateway (conftest: openai_*), shared by the gateway
# modules that alias these; test_openai_structured serves its own checkpoint.
@pytest.fixture(scope="module")
def model_dir(openai_model_dir: Path) -> Path:
    return openai_model_dir


@pytest.fixture(scope="module")
def server(openai_server: TritonServer) -> TritonServer:
    return openai_server


@pytest.fixture(scope="module")
def gateway(openai_gateway: str) -> str:
    return openai_gateway


@pytest.fixture(scope="module")
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def offline(llm: LLM, prompt: str, **params: Any) -> str:
    """The text the offline engine streams for `prompt` (greedy unless `params` say otherwise).
    The gateway streams from Triton even for a non-streamed answer (so that a client that
    disconnects cancels), so its text is the streamed deltas joined: the same as the offline
    API's text for valid UTF-8, while the tiny model's random tokens may cut characters."""
    return offline_text(llm, prompt, stream=True, **{"max_tokens": MAX_TOKENS, **params})


def rendered_chat(model_dir: Path, tokenizer: Tokenizer) -> str:
    template = ChatTemplate.from_model_dir(model_dir, tokenizer)
    assert template is not None
    return template.render(MESSAGES)


# --- completions ----------------------------------------------------------------------------


def test_models_and_health(client: openai.OpenAI, gateway: str) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{gateway}/health").json() == {"status": "ok"}


def test_completion_matches_offline(client: openai.OpenAI, llm: LLM, tokenizer: Tokenizer) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, **GREEDY)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert abs(out.created - time.time()) < 60
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].text == offline(llm, PROMPT)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


def test_completion_stream_matches_offline(
    client: openai.OpenAI, llm: LLM, tokenizer: Tokenizer
) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == offline(llm, PROMPT)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS


def test_completion_prompts_n_echo_logprobs(
    client: openai.OpenAI, llm: LLM, tokenizer: Tokenizer
) -> None:
    prompts = [PROMPT, "Paged attention stores"]
    out = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=MAX_TOKENS, echo=True, **GREEDY
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt-major, as OpenAI
    for choice in out.choices:
        prompt = prompts[choice.index // 2]
        assert choice.text == prompt + offline(llm, prompt)
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 4 * MAX_TOKENS

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=0, **GREEDY
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.tokens == [tokenizer.decode([i], False) for i in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx(
        [next(iter(d.values())).logprob for d in expected.logprobs or []], abs=1e-4
    )
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0


def test_seeded_samples_are_reproducible(client: openai.OpenAI, llm: LLM) -> None:
    """n samples with a seed are Triton requests with seeds seed, seed+1, ..."""
    kwargs: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, seed=7, max_tokens=MAX_TOKENS, **kwargs
    )
    expected = [offline(llm, PROMPT, temperature=1.0, top_p=0.9, seed=seed) for seed in (7, 8)]
    assert [c.text for c in out.choices] == expected
    assert expected[0] != expected[1]
    # streamed: the two samples' chunks interleave, each tagged with its index
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=7, max_tokens=MAX_TOKENS, stream=True, **kwargs
    )
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    out2 = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=7, max_tokens=MAX_TOKENS, **kwargs
    )
    assert texts == [c.message.content for c in out2.choices]


# --- chat -----------------------------------------------------------------------------------


def test_chat_template_renders_as_transformers(model_dir: Path, tokenizer: Tokenizer) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered_chat(model_dir, tokenizer) == expected


def test_chat_drops_the_bos_a_tokenizer_adds_itself(model_dir: Path, tmp_path: Path) -> None:
    """With a tokenizer that adds a BOS, a template's leading BOS is dropped from the text:
    Triton's tokenizer model adds it back once, as transformers' tokenized chat has it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    hf.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = Tokenizer(hf)
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "<s>",
        strip_bos=True,
    )
    text = template.render(MESSAGES)
    assert not text.startswith("<s>")
    assert tokenizer.encode(text)[:2] == [0, *tokenizer.encode(MESSAGES[0]["content"], False)[:1]]


def test_chat_matches_offline(
    client: openai.OpenAI, llm: LLM, tokenizer: Tokenizer, model_dir: Path
) -> None:
    prompt = rendered_chat(model_dir, tokenizer)
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=MAX_TOKENS,
        **GREEDY,
    )
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == offline(llm, prompt)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == MAX_TOKENS

    # the deprecated max_tokens, log-probs of the chosen tokens
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=0,
        **GREEDY,
    )
    content = out.choices[0].logprobs.content
    assert content is not None and len(content) == MAX_TOKENS
    assert all(c.logprob <= 0 and c.top_logprobs == [] for c in content)
    assert out.choices[0].message.content == offline(llm, prompt)


def test_chat_stream_matches_offline(
    client: openai.OpenAI, llm: LLM, tokenizer: Tokenizer, model_dir: Path
) -> None:
    prompt = rendered_chat(model_dir, tokenizer)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    text = "".join(c.choices[0].delta.content or "" for c in text_chunks)
    assert text == offline(llm, prompt)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS
    # without include_usage: no usage chunk, no usage field
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            **GREEDY,
        )
    )
    assert all(c.choices and c.usage is None for c in chunks)


# --- cancellation ---------------------------------------------------------------------------


ABORTED = "vllm:request_success_total{finished_reason=abort}"
FINISHED = "vllm:request_success_total{finished_reason=length}"


def assert_disconnect_aborts(server: TritonServer, start_and_leave: Callable[[], None]) -> None:
    """`start_and_leave()` starts a long request and disconnects while the engine runs it: the
    engine aborts it and its KV blocks are free within 2 s. On a loaded machine the tiny model
    may finish before the disconnect reaches it: then it is tried again (3 times at most)."""
    for _attempt in range(3):
        before = metrics(server.metrics_url)
        start_and_leave()
        elapsed = wait_idle(server.metrics_url, timeout=30)
        after = metrics(server.metrics_url)
        if after.get(ABORTED, 0) == before.get(ABORTED, 0) + 1:
            assert elapsed < 2.0
            return
        assert after.get(FINISHED, 0) == before.get(FINISHED, 0) + 1, (before, after)
    pytest.fail("the request finished before the client left, 3 times")


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_disconnect_mid_stream_frees_blocks(
    gateway: str, server: TritonServer, endpoint: str
) -> None:
    body = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    request = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "stream": True, **body}

    def start_and_leave() -> None:
        with httpx.stream("POST", f"{gateway}/v1/{endpoint}", json=request, timeout=60) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # the connection is closed mid-stream

    assert_disconnect_aborts(server, start_and_leave)


def test_disconnect_while_waiting_for_a_whole_completion(
    gateway: str, server: TritonServer
) -> None:
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True})
    host, port = gateway.removeprefix("http://").split(":")
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"

    def start_and_leave() -> None:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"{head}Content-Type: application/json\r\n\r\n{body}".encode())
            deadline = time.monotonic() + 10
            while metrics(server.metrics_url).get("vllm:num_requests_running") != 1:
                assert time.monotonic() < deadline, "the request never ran"
        # closed before the answer came

    assert_disconnect_aborts(server, start_and_leave)


# --- the README ---------------------------------------------------------------------------


def readme_curl_commands() -> list[str]:
    text = README.read_text()
    section = text.split("## OpenAI-compatible API", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("curl "):
                commands.append(command)
    return commands


def test_readme_curl_examples_work_verbatim(gateway: str) -> None:
    commands = readme_curl_commands()
    assert len(commands) == 3
    outputs = []
    for command in commands:
        # only the address and the model's name differ from the README
        command = command.replace("localhost:9000", gateway.removeprefix("http://"))
        command = command.replace("SmolLM2-135M-Instruct", MODEL)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert json.loads(outputs[0])["data"][0]["id"] == MODEL
    completion = json.loads(outputs[1])
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"]
    events = [line[6:] for line in outputs[2].splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
