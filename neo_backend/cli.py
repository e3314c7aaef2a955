"""Command line: `python -m neo_backend {generate,serve,prepare-model,build-kernel}`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing

from .config import EngineConfig
from .core.sampling_params import SamplingParams
from .errors import NeoError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Values are read by `SamplingParams.parse_strings`, with the same rules as every other knob."""
    group = parser.add_argument_group("sampling (vLLM names)")
    hints = typing.get_type_hints(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif f.name == "stop":
            group.add_argument(flag, action="append", help="stop string (repeatable)")
        elif f.name == "stop_token_ids":
            group.add_argument(flag, type=int, action="append", help="stop token id (repeatable)")
        else:
            group.add_argument(flag, default=None)


def _sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(SamplingParams)
        if getattr(args, f.name, None) is not None
    }
    return SamplingParams.from_dict(SamplingParams.parse_strings(values, source="flag"))


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import LLMEngine

    params = _sampling_from_args(args)  # a bad flag fails before the model loads
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    request_id = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished and out.request_id == request_id:
                final = out
    sys.stdout.write("\n")
    if final is not None and final.error:
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    if args.stats:
        print(json.dumps(engine.stats_snapshot()), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .triton.server import serve

    return serve()


def cmd_prepare_model(args: argparse.Namespace) -> int:
    """Resolve the model and convert its tokenizer ahead of time, so the first server start is quick."""
    from .models.loader import load_tokenizer, read_model_config, resolve_source

    config = EngineConfig.from_cli_args(args)
    source = resolve_source(config)
    cfg = read_model_config(source)
    load_tokenizer(source, config, cfg)
    print(f"model ready: {source.path} ({source.load_format}, {cfg.num_layers} layers, vocab {cfg.vocab_size})")
    return 0


def cmd_build_kernel(args: argparse.Namespace) -> int:
    from .cpu import build, library

    path = build.build(force=args.force)
    print(
        f"CPU attention library: {path} (SIMD path: {library.best_isa(library.load(path))}, "
        f"threads: {len(os.sched_getaffinity(0))})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m neo_backend", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stats", action="store_true", help="print one JSON line of engine counters on stderr")
    _add_sampling_args(gen)
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="start Triton Inference Server with the neo model")
    serve.set_defaults(func=cmd_serve)
    kernel = sub.add_parser("build-kernel", help="compile the CPU attention library (cached) and print its path")
    kernel.add_argument("--force", action="store_true", help="recompile even if a cached build exists")
    kernel.set_defaults(func=cmd_build_kernel)
    prep = sub.add_parser("prepare-model", help="check the model and cache its converted tokenizer")
    EngineConfig.add_cli_args(prep)
    prep.set_defaults(func=cmd_prepare_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        return args.func(args)
    except NeoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
