"""The `antiphon` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="antiphon", description="Antiphon serving engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate offline with a model (default: the embedded one)")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    generate.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2)")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    generate.add_argument("--verbose", action="store_true")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "generate":
        return _generate(args)
    return 2


def _generate(args) -> int:
    from transformers.utils import logging as hf_logging

    from engine import LLM, SamplingParams

    hf_logging.disable_progress_bar()
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens)
    except ValueError as exc:
        print(f"antiphon: {exc}", file=sys.stderr)
        return 2
    llm = LLM(args.model)
    prompts = args.prompt if args.raw else [
        llm.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
    # One prompt streams as it is generated; several print in order when all are done.
    if len(prompts) == 1:
        for out in llm.stream(prompts, params):
            print(out.new_text, end="", flush=True)
        print()
    else:
        for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
            print(f"### {prompt}\n{out.text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
