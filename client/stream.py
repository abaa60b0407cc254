"""Stream one generation from the `ensemble` model over gRPC and print the text as it arrives.

    python -m client.stream "Once upon a time," [--url localhost:8001] [--max-tokens 64]

The text goes to stdout, delta by delta; one summary line goes to stderr:
`finish_reason=length prompt_tokens=5 output_tokens=64 ttft_ms=41.0 tokens_per_s=52.3`
(tokens_per_s: output tokens over the whole request time, TTFT included). A failed request
or an unreachable server exits with status 1 and the reason on stderr.

The helpers (`GenerationParams`, `make_inputs`, `stream_generate`, `is_final`) are reused by
`client.benchmark`.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

DEFAULT_URL = "localhost:8001"
DEFAULT_MODEL = "ensemble"


class ClientError(RuntimeError):
    """A request that failed (the server's message) or a server that cannot be reached."""


@dataclass(frozen=True)
class GenerationParams:
    """What a request asks for; `None` leaves the server's default. `sampling_parameters` is
    a JSON object with vLLM's names, sent as is (the server rejects unknown keys)."""

    max_tokens: int | None = 64
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stop: tuple[str, ...] = ()
    sampling_parameters: str | None = None


class Delta(NamedTuple):
    """One streamed response: its new text, `finish_reason` ("" until the last response) and
    the cumulative token counts."""

    text: str
    finish_reason: str
    num_output_tokens: int
    num_input_tokens: int


# input name -> (Triton datatype, numpy dtype) of the optional scalars
_SCALARS = {
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "seed": ("UINT64", np.uint64),
    "ignore_eos": ("BOOL", np.bool_),
}


def _tensor(name: str, datatype: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def make_inputs(prompt: str, params: GenerationParams) -> list[grpcclient.InferInput]:
    """The input tensors of one streamed request to `ensemble`."""
    inputs = [
        _tensor("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_)),
        _tensor("stream", "BOOL", np.array([True])),
    ]
    for name, (datatype, np_dtype) in _SCALARS.items():
        value = getattr(params, name)
        if value is not None:
            inputs.append(_tensor(name, datatype, np.array([value], dtype=np_dtype)))
    if params.stop:
        words = np.array([w.encode() for w in params.stop], dtype=np.object_)
        inputs.append(_tensor("stop_words", "BYTES", words))
    if params.sampling_parameters is not None:
        raw = np.array([params.sampling_parameters.encode()], dtype=np.object_)
        inputs.append(_tensor("sampling_parameters", "BYTES", raw))
    return inputs


def is_final(result: grpcclient.InferResult) -> bool:
    """The last response of a request (it may carry data or be empty)."""
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def has_data(result: grpcclient.InferResult) -> bool:
    return len(result.get_response().outputs) > 0


def to_delta(result: grpcclient.InferResult) -> Delta:
    def scalar(name: str) -> Any:
        array = result.as_numpy(name)
        return None if array is None else array.reshape(-1)[0]

    text, reason = scalar("text_output"), scalar("finish_reason")
    return Delta(
        text=text.decode("utf-8") if text is not None else "",
        finish_reason=reason.decode() if reason is not None else "",
        num_output_tokens=int(scalar("num_output_tokens") or 0),
        num_input_tokens=int(scalar("num_input_tokens") or 0),
    )


def error_message(error: BaseException) -> str:
    if isinstance(error, InferenceServerException):
        return str(error.message())
    return str(error)


def connect(url: str, timeout: float = 10.0) -> grpcclient.InferenceServerClient:
    """A client of a live server; ClientError if none answers at `url`."""
    client = grpcclient.InferenceServerClient(url)
    try:
        live = client.is_server_live(client_timeout=timeout)
    except InferenceServerException as e:
        client.close()
        raise ClientError(f"cannot reach a Triton server at {url}: {error_message(e)}") from None
    if not live:
        client.close()
        raise ClientError(f"the Triton server at {url} is not live")
    return client


def stream_generate(
    client: grpcclient.InferenceServerClient,
    prompt: str,
    params: GenerationParams,
    *,
    model: str = DEFAULT_MODEL,
    timeout: float = 600.0,
) -> Iterator[Delta]:
    """Send one streamed request on a new gRPC stream of `client` and yield each response
    that carries data, up to the final one. Raises ClientError with the server's message if
    the request fails, or if no response comes for `timeout` seconds. Closing the iterator
    early cancels the request."""
    responses: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    done = False
    try:
        client.async_stream_infer(
            model, make_inputs(prompt, params), enable_empty_final_response=True
        )
        while not done:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise ClientError(f"no response from the server for {timeout:g} s") from None
            if error is not None:
                done = True  # an error ends the request
                raise ClientError(error_message(error))
            done = is_final(result)
            if has_data(result):
                yield to_delta(result)
    except InferenceServerException as e:
        raise ClientError(error_message(e)) from None
    finally:
        client.stop_stream(cancel_requests=not done)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m client.stream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("prompt")
    ap.add_argument("--url", default=DEFAULT_URL, help="gRPC host:port (default %(default)s)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="default %(default)s")
    ap.add_argument("--max-tokens", type=int, default=64, help="default %(default)s")
    ap.add_argument("--temperature", type=float, default=0.0, help="default %(default)s (greedy)")
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--ignore-eos", action="store_true", default=None)
    ap.add_argument("--stop", nargs="+", default=[], metavar="STR", help="stop strings")
    ap.add_argument(
        "--sampling-parameters",
        metavar="JSON",
        help="a JSON object with vLLM names, e.g. '{\"min_p\": 0.1}'; the flags above override it",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait per response")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    params = GenerationParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
        sampling_parameters=args.sampling_parameters,
    )
    client = connect(args.url)
    start = time.perf_counter()
    first: float | None = None
    last = Delta("", "", 0, 0)
    try:
        for delta in stream_generate(
            client, args.prompt, params, model=args.model, timeout=args.timeout
        ):
            first = first or time.perf_counter()
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            last = delta._replace(finish_reason=delta.finish_reason or last.finish_reason)
    except ClientError:
        if first is not None:
            print(flush=True)  # ends the partial text
        raise
    finally:
        client.close()
    print(flush=True)
    elapsed = time.perf_counter() - start
    summary = {
        "finish_reason": last.finish_reason or "-",
        "prompt_tokens": last.num_input_tokens,
        "output_tokens": last.num_output_tokens,
        "ttft_ms": "-" if first is None else f"{(first - start) * 1e3:.1f}",
        "tokens_per_s": f"{last.num_output_tokens / elapsed:.1f}",
    }
    print(" ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted (request cancelled)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
