"""`python -m openai_frontend`: serve the OpenAI-compatible API in front of a running Triton server."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import uvicorn

from .app import create_app
from .config import GatewayConfig


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    defaults = GatewayConfig.from_env()
    p = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__)
    p.add_argument("--host", default=defaults.host, help="address to listen on (NEO_OPENAI_HOST, else NEO_HOST)")
    p.add_argument("--port", type=int, default=defaults.port, help="port (NEO_OPENAI_PORT)")
    p.add_argument(
        "--triton-url",
        default=defaults.triton_url,
        help="Triton gRPC host:port (NEO_OPENAI_TRITON_URL, else NEO_HOST/NEO_GRPC_PORT)",
    )
    p.add_argument("--model", default=defaults.model, help="the Triton model, and the model id clients send")
    p.add_argument(
        "--request-timeout", type=float, default=defaults.request_timeout_s, help="seconds allowed per generation"
    )
    args = p.parse_args(argv)
    # The API key only from the environment (NEO_OPENAI_API_KEY): a command line is visible to every user.
    return dataclasses.replace(
        defaults,
        host=args.host,
        port=args.port,
        triton_url=args.triton_url,
        model=args.model,
        request_timeout_s=args.request_timeout,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("openai_frontend").info(
        "OpenAI API on http://%s:%d/v1 for Triton model %s at %s%s",
        config.host,
        config.port,
        config.model,
        config.triton_url,
        " (API key required)" if config.api_key else "",
    )
    # grpc.aio runs on asyncio's own loop; access logs would cost more than the gateway's own work per request.
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        loop="asyncio",
        http="httptools",
        access_log=False,
        log_level="info",
    )


if __name__ == "__main__":
    main()
