"""`pagedllm serve` starts the OpenAI gateway beside tritonserver: the real command answers a
chat completion through it (the official `openai` client; the text the offline engine streams
for the prompt transformers' chat template makes), prints a chat `curl` first, and a Ctrl-C
stops both processes (nothing survives). A gateway that cannot start fails `serve` clearly:
its port taken before the start (nothing started), or after tritonserver is up (tritonserver
stopped again)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from openai_gateway import MODEL

from pagedllm import LLM, SamplingParams
from pagedllm.cli import main
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.serving import launcher, pytriton_wheel
from pagedllm.serving.gateway import GatewayOptions, gateway_command
from pagedllm.serving.tritonserver import CPU_QUIET_ARGS, TritonServer, free_port

MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]
MAX_TOKENS = 8
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port someone else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


# --- the command line -------------------------------------------------------------------------


def test_serve_passes_the_gateway_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(launcher, "serve", lambda *args: calls.append(args[-1]) or 0)
    assert main(["serve", "--model", "/m"]) == 0
    argv = ["serve", "--model", "/m", "--openai-port=9123", "--openai-host=0.0.0.0"]
    argv += ["--served-model-name=chat", "--chat-template=t.jinja", "--trust-request-chat-template"]
    assert main(argv) == 0
    assert main(["serve", "--model", "/m", "--no-openai"]) == 0
    assert calls == [
        GatewayOptions(),
        GatewayOptions(9123, "0.0.0.0", "chat", "t.jinja", trust_request_chat_template=True),
        None,
    ]
    assert GatewayOptions().port == 9000 and GatewayOptions().host == "127.0.0.1"
    with pytest.raises(SystemExit):
        main(["serve", "--openai-port=0"])  # --no-openai is the spelling
    with pytest.raises(SystemExit):
        main(["serve", "--no-openai", "--served-model-name=chat"])  # no gateway to pass it to


def test_openai_trusts_request_templates_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr("pagedllm.openai.app.serve", lambda config, *_: seen.append(config) or 0)
    monkeypatch.delenv("PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE", raising=False)
    assert main(["openai", "--model-dir", "/m"]) == 0
    assert main(["openai", "--model-dir", "/m", "--trust-request-chat-template"]) == 0
    monkeypatch.setenv("PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE", "true")  # the flag's default
    assert main(["openai", "--model-dir", "/m"]) == 0
    assert [c.trust_request_chat_template for c in seen] == [False, True, True]


def test_the_gateway_command_is_pagedllm_openai_on_tritons_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    options = GatewayOptions(9001, "0.0.0.0", "chat", "t.jinja", trust_request_chat_template=True)
    cmd = gateway_command(options, "/m", "127.0.0.1:8001", "http://127.0.0.1:8002/metrics")
    assert cmd[:4] == [sys.executable, "-m", "pagedllm.cli", "openai"]
    seen: list[Any] = []
    monkeypatch.setattr("pagedllm.openai.app.serve", lambda *a: seen.append(a) or 0)
    assert main(cmd[3:]) == 0  # the real parser
    (config, host, port), chat_template = seen[0], str(Path("t.jinja").resolve())
    assert (host, port, config.triton_url, config.model_dir) == ("0.0.0.0", 9001, cmd[4][13:], "/m")
    assert config.metrics_url == "http://127.0.0.1:8002/metrics"
    assert (config.served_model_name, config.chat_template) == ("chat", chat_template)
    assert config.trust_request_chat_template


def test_a_taken_gateway_port_fails_before_anything_starts(
    taken_port: int, openai_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "serve.log"
    argv = ["serve", "--model", str(openai_model_dir), f"--log-file={log}"]
    assert main([*argv, f"--openai-port={taken_port}"]) == 1
    err = capsys.readouterr().err
    assert f"the OpenAI gateway cannot listen on 127.0.0.1:{taken_port}" in err
    assert "--openai-port PORT, or --no-openai" in err
    assert not log.exists()  # no tritonserver was started


@pytest.fixture
def empty_triton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[TritonServer]:
    """`serve` on a tritonserver with an empty model repository (up in a second; the gateway
    in front of it never reports ready: there is no `ensemble`); the servers it made."""
    (tmp_path / "repo").mkdir()
    servers: list[TritonServer] = []

    def make_server(*_: Any, **kwargs: Any) -> TritonServer:
        backend = pytriton_wheel.prepare_backend_dir(tmp_path / "backends")
        servers.append(TritonServer([tmp_path / "repo"], backend, log_path=kwargs["log_file"]))
        servers[0].extra_args = list(CPU_QUIET_ARGS)
        return servers[0]

    monkeypatch.setattr(launcher, "make_server", make_server)
    return servers


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_gateway_that_fails_after_triton_started_stops_it(
    taken_port: int,
    openai_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    empty_triton: list[TritonServer],
) -> None:
    """The race the port check cannot see: the gateway's port is taken once tritonserver is
    up."""
    monkeypatch.setattr(launcher, "port_in_use", lambda options: "")
    argv = ["serve", "--model", str(openai_model_dir), f"--log-file={tmp_path / 'triton.log'}"]
    before = children()
    started = time.monotonic()
    assert main([*argv, f"--openai-port={taken_port}"]) == 1
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert re.search(r"the OpenAI gateway's start-up failed \(exit code [1-9]\d*\)", err), err
    assert str(tmp_path / "triton.openai.log") in err
    assert "address already in use" in err  # uvicorn's own words, quoted from its log
    assert empty_triton[0].process is None  # stopped
    assert children() <= before  # neither tritonserver nor the gateway survive


def test_sigterm_while_the_gateway_starts_stops_both(
    openai_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    empty_triton: list[TritonServer],
) -> None:
    before = children()

    def sigterm_once_the_gateway_runs() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for p in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "openai" in p.cmdline() and p.pid not in before:
                        time.sleep(1)  # well into its start
                        os.kill(os.getpid(), signal.SIGTERM)  # serve's handler: set by now
                        return
            time.sleep(0.1)

    killer = threading.Thread(target=sigterm_once_the_gateway_runs)
    killer.start()
    argv = ["serve", "--model", str(openai_model_dir), f"--log-file={tmp_path / 'triton.log'}"]
    try:
        assert main([*argv, f"--openai-port={free_port()}"]) == 0
    finally:
        killer.join()
    assert capsys.readouterr().out.rstrip().endswith("stopped")
    assert empty_triton[0].process is None
    assert children() <= before
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # serve's handler is gone again


def test_old_gateway_logs_go_with_their_servers(tmp_path: Path) -> None:
    """A server log's `.openai.log` (the gateway `serve` started beside it) is deleted with it
    and does not count as a server log of its own."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    logs = [tmp_path / f"tritonserver-2000010{i}-000000-pid{dead}-x.log" for i in range(1, 4)]
    for log in logs:
        log.touch()
        launcher.log_path_beside(log).touch()
    new = launcher.new_log_file(tmp_path, keep=2)
    kept = [logs[1], logs[2], *map(launcher.log_path_beside, logs[1:])]
    assert set(tmp_path.iterdir()) == {new, *kept}


# --- the real command -------------------------------------------------------------------------


def offline_stream(llm: LLM, prompt_ids: list[int]) -> str:
    """The offline engine's streamed deltas joined (the gateway's text: it streams from
    Triton even for a non-streamed answer)."""
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    llm.engine.add_request("chat", prompt_ids, params)
    texts = []
    while llm.engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in llm.engine.step()]
    return "".join(texts)


def chat_prompt_ids(model_dir: Path) -> list[int]:
    """transformers' tokenized chat: the template rendered and tokenized as HF does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while text not in (out := path.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, out
        time.sleep(0.2)
    return out


def readme_chat_examples(gateway: str) -> tuple[str, str]:
    """The first curl command and the first Python block of the README's opening (before its
    first section), for `gateway` (http://HOST:PORT) and the tiny model."""
    opening = README.read_text().split("\n## ", 1)[0]
    opening = opening.replace("http://localhost:9000", gateway)
    opening = opening.replace("localhost:9000", gateway.removeprefix("http://"))
    opening = opening.replace("SmolLM2-135M-Instruct", MODEL)
    blocks = re.findall(r"```bash\n(.*?)```", opening, re.S)
    commands = [c for b in blocks for c in b.replace("\\\n", " ").splitlines()]
    curl = next(c for c in commands if c.startswith("curl "))
    return curl, re.findall(r"```python\n(.*?)```", opening, re.S)[0]


def test_serve_answers_chat_through_the_gateway_and_ctrl_c_stops_both(
    openai_model_dir: Path, tmp_path: Path
) -> None:
    port, out = free_port(), tmp_path / "serve.out"
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(openai_model_dir)]
    cmd += ["--dtype=float32", f"--log-file={tmp_path / 'triton.log'}", f"--openai-port={port}"]
    cmd += [f"--{name}-port={free_port()}" for name in ("http", "grpc", "metrics")]
    with open(out, "wb") as f:
        serve = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        printed = wait_for(out, "Ctrl-C stops it.", serve, 300)
        url = f"http://127.0.0.1:{port}"
        assert f"OpenAI  {url}/v1 (model {MODEL})" in printed
        tries = printed.split("try:\n", 1)[1].splitlines()
        assert tries[0].strip().startswith(f"curl -s {url}/v1/chat/completions"), tries
        assert "/v2/models/ensemble/generate_stream" in tries[1]

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        llm = LLM(str(openai_model_dir), dtype="float32")
        assert answer.choices[0].message.content == offline_stream(
            llm, chat_prompt_ids(openai_model_dir)
        )
        assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS

        # what serve printed first, and the README's first requests: chat completions
        curl, python = readme_chat_examples(url)
        assert "/v1/chat/completions" in curl
        for command in (tries[0], curl):
            done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=60)
            assert json.loads(done.stdout)["object"] == "chat.completion", (command, done)
        done = subprocess.run([sys.executable, "-c", python], capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr

        family = [psutil.Process(serve.pid), *psutil.Process(serve.pid).children(recursive=True)]
        names = " ".join(" ".join(p.cmdline()) for p in family)
        assert "tritonserver" in names and "pagedllm.cli openai" in names, names
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C at the terminal: serve's process group
        assert serve.wait(90) == 0, out.read_text()
        _, alive = psutil.wait_procs(family, timeout=5)
        assert not alive, alive
        assert out.read_text().rstrip().endswith("stopped")
    finally:
        if serve.poll() is None:
            for p in psutil.Process(serve.pid).children(recursive=True):
                p.kill()
            serve.kill()
            serve.wait()
