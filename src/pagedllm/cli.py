"""`pagedllm` command line: `pagedllm prepare-model`, `pagedllm generate`."""

from __future__ import annotations

import argparse
import sys

from pagedllm import prepare


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    model = args.model or str(prepare.prepare_smollm2())
    llm = LLM(model, dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        print(out.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedllm")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-model", help="convert the default SmolLM2 model (cached)")
    p.add_argument("--dest", default=None, help="target directory")
    p.add_argument("--force", action="store_true", help="convert again")
    g = sub.add_parser("generate", help="greedy generation with the offline engine")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--model", default=None, help="HF model dir (default: SmolLM2)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    s = sub.add_parser("serve", help="serve the model repository with tritonserver (CPU)")
    s.add_argument("--model", default=None, help="HF model dir (default: SmolLM2)")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    args = ap.parse_args(argv)
    if args.command == "serve":
        from pagedllm.serving.launcher import serve

        model = args.model or str(prepare.prepare_smollm2())
        return serve(model, args.http_port, args.grpc_port, args.metrics_port, args.dtype)
    if args.command == "prepare-model":
        argv2 = (["--dest", args.dest] if args.dest else []) + (["--force"] if args.force else [])
        return prepare.main(argv2)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
