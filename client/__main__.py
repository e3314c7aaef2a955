"""`python -m client "prompt" [--chat] [--max-tokens N] ... [--stats]`: stream one generation to stdout.

Exit status: 0 done, 1 server-side error, 2 bad arguments, 3 server unreachable, 4 model missing,
5 timeout, 130 interrupted (the request is cancelled on the server).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .chat import DEFAULT_CHAT_TEMPLATE, load_template, render_chat
from .errors import ClientError
from .protocol import DEFAULT_MODEL, DEFAULT_TIMEOUT_S, default_url
from .sync import NeoClient


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("prompt", help="prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with a chat template")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja2 chat template (default: ChatML of SmolLM2)")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", nargs="+", default=None, help="stop strings")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--url", default=None, help=f"gRPC host:port (default from NEO_HOST/NEO_GRPC_PORT: {default_url()})")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds for the whole request")
    p.add_argument("--stats", action="store_true", help="print TTFT, mean TPOT and tokens/s to stderr at the end")
    return p.parse_args(argv)


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM SamplingParams names; unset options are left to the server's defaults."""
    values = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos or None,
    }
    return {k: v for k, v in values.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    streamed = False  # whether stdout holds a partial line to end before a message
    try:
        if args.chat:
            template = load_template(args.chat_template) if args.chat_template else DEFAULT_CHAT_TEMPLATE
            prompt = render_chat(prompt, args.system, template)
        with NeoClient(args.url, args.model, args.timeout) as client:
            client.check_ready()
            with client.stream(prompt, sampling_from_args(args)) as stream:
                for delta in stream:
                    streamed = True
                    sys.stdout.write(delta)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            streamed = False
            if args.stats and stream.result is not None:
                print(stream.result.stats_line(), file=sys.stderr)
    except ClientError as exc:
        _end_line(streamed)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        _end_line(streamed)
        print("interrupted: the request was cancelled on the server", file=sys.stderr)
        return 130
    return 0


def _end_line(streamed: bool) -> None:
    if streamed:
        sys.stdout.write("\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
