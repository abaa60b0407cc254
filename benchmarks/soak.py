"""Soak test: one real tritonserver and the OpenAI gateway under a mix of concurrent clients over
every protocol for --minutes, with cancels, disconnects and malformed requests. Prints JSON (and
writes it with --output); exits 1 unless every `checks` count is 0.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--model DIR | --tiny] [--dtype float32]
                                        [--concurrency 6] [--seed 0] [--output FILE]

Set-up: `tritonserver` (`pagedllm.serving.launcher.make_server`) with SmolLM2-135M-Instruct in
float32 (or --model DIR; --tiny builds a tiny random llama checkpoint with a chat template in a
temporary directory, for a quick run) and `pagedllm openai` as a subprocess in front of it.

Oracle: a few prompt specs (prompt, max_tokens, stop strings; greedy with ignore_eos), each
asked once at start, one request at a time, over each protocol family: `whole` (HTTP generate,
non-streamed: also the KServe `llm` and non-streamed gRPC answers), `stream` (gRPC streaming,
deltas joined: also HTTP generate_stream and the gateway's completions, which stream from
Triton) and `chat` (the gateway's chat completions). During the soak every completed greedy
request with one of these specs must give the same text. The engine is batch-invariant in
float32 only: with another --dtype a different text is reported, but does not fail the run.

Load: --concurrency worker threads, each sending one request at a time, picked at random
(soak_parts.plans.MIX): the protocols (HTTP generate / generate_stream and KServe infer on
`llm`; unary gRPC infer on `llm`; gRPC streaming on `ensemble` with stream true and false; the
gateway's /v1/completions and /v1/chat/completions, streamed or not), greedy or sampled,
non-streamed Triton texts with or without the prompt (exclude_input_in_output); cancels (gRPC
stop_stream(cancel_requests=True) after a few responses, HTTP and gateway streams closed
mid-stream), disconnects (unary gRPC with a short client_timeout, a gateway or HTTP generate
client that closes its connection while waiting); and soak_parts.bad_inputs.BAD_REQUESTS, which
must get a 4xx (gRPC INVALID_ARGUMENT, or an error on the stream). A busy server's refusal (429,
503, "server busy") counts as `busy`, not as a failure. NOTE: Triton's HTTP frontend does not
cancel a non-streamed request whose client disconnected (it notices only when it writes the
answer), so those requests run to their end: not counted as cancels.

Checks, each a count that must be 0:
- hung: no end within --request-timeout (a client blocked past it where no timeout reaches,
  e.g. in tritonclient's stop_stream, is found when the load stops);
- lost: an answer that ended without its last part (no finish_reason, response indexes not
  0..n-1, the connection closed, a broken body);
- wrong_text: a greedy text that differs from the oracle's (not counted unless float32);
- unexpected_5xx: HTTP 5xx, gRPC INTERNAL / UNKNOWN / UNAVAILABLE (other than "server busy"),
  or a message that says "internal error" (Triton's generate answers every model error 400);
- unexpected_error: a good request refused, or a bad one accepted;
- kv_not_at_rest: vllm:num_requests_running, _waiting and vllm:kv_cache_usage_perc not all 0
  within --idle-timeout s after the load;
- engine_finished_minus_requests_sent: the requests the engine finished during the soak
  (vllm:request_success_total, stop + length + abort) minus the requests the clients sent it
  (answered, cancelled or disconnected; bad and refused ones never reach it): each started
  request finished exactly once;
- server_restarted, stubs_restarted: the tritonserver process exited, a stub's pid changed.

Also reported: requests per protocol and outcome, latency per protocol, the engine's counters
over the soak (aborts among them, next to the cancels sent), and the RSS, open file descriptors
and threads of tritonserver, each stub and the gateway at the start, midway and at the end,
with their change per 1,000 requests over the whole soak and over its second half.

The code: this file parses the arguments; soak_parts/ (its docstring maps the modules) does
the rest.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from soak_parts.report import dumps, report
from soak_parts.run import soak, tiny_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama (quick run)")
    ap.add_argument("--dtype", default="float32", help="the text check needs float32")
    ap.add_argument("--concurrency", type=int, default=6, help="client threads")
    ap.add_argument("--prompts", type=int, default=8, help="prompt specs (oracle entries)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=180.0, help="seconds: else hung")
    ap.add_argument("--idle-timeout", type=float, default=10.0, help="seconds to be at rest")
    ap.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--output", default=None, help="also write the JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(tmp)
        if args.tiny:
            model_dir = tiny_model(work)
        elif args.model:
            model_dir = Path(args.model).resolve()
        else:
            from pagedllm.prepare import prepare_smollm2

            model_dir = prepare_smollm2()
        args.model_name = model_dir.name
        state, seen = soak(args, model_dir, work)
        result = report(args, state, seen)
        if not result["passed"]:
            result["gateway_log_tail"] = (work / "gateway.log").read_text(errors="replace")[-3000:]
    text = dumps(result)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
