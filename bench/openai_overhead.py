"""What the OpenAI gateway adds: TTFT through it against TTFT through Triton gRPC directly, side by side.

Against a running stack (`make serve`: Triton gRPC on NEO_GRPC_PORT, the gateway on NEO_OPENAI_PORT).
`--concurrency` workers each send, again and again, the same prompt down both paths at the same moment (exactly
`--output-tokens` tokens each) and wait for both: `--concurrency` streams run through the gateway and as many
directly, side by side, so both paths meet the engine in the same state. The direct path is the project's
asyncio client; the gateway path is the official `openai` SDK. TTFT is the time from sending a request to its
first non-empty text. Each worker's first pair is a warm-up.

    python bench/openai_overhead.py --requests 25 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import AsyncNeoClient, default_url  # noqa: E402
from loadtest.workloads import words  # noqa: E402
from openai_frontend import GatewayConfig  # noqa: E402

Request = Callable[[str], Awaitable[float]]  # prompt -> TTFT seconds


def direct(client: AsyncNeoClient, output_tokens: int) -> Request:
    async def one(prompt: str) -> float:
        result = await client.generate(prompt, {"max_tokens": output_tokens, "temperature": 0, "ignore_eos": True})
        assert result.ttft is not None and result.num_output_tokens == output_tokens
        return result.ttft

    return one


def through_gateway(api: openai.AsyncOpenAI, model: str, output_tokens: int) -> Request:
    async def one(prompt: str) -> float:
        start = time.perf_counter()
        ttft = None
        stream = await api.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=output_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.perf_counter() - start
        assert ttft is not None
        return ttft

    return one


async def run(args: argparse.Namespace) -> dict:
    async with AsyncNeoClient(args.url, args.model, timeout=args.timeout) as client:
        api = openai.AsyncOpenAI(
            base_url=f"{args.openai_url}/v1", api_key=args.api_key or "unused", timeout=args.timeout, max_retries=0
        )
        await client.check_ready()
        gateway = through_gateway(api, args.model, args.output_tokens)
        grpc = direct(client, args.output_tokens)
        pairs: list[tuple[float, float]] = []  # (gateway, direct) TTFT of one prompt sent down both at once

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            for i in range(args.requests + 1):
                prompt = words(rng, args.input_tokens)
                pair = await asyncio.gather(gateway(prompt), grpc(prompt))
                if i > 0:
                    pairs.append(pair)

        await asyncio.gather(*(worker(args.seed + w) for w in range(args.concurrency)))
        await api.close()
    by_path = {"gateway": [g for g, _ in pairs], "direct": [d for _, d in pairs]}
    report: dict = {
        name: {
            "median_ms": statistics.median(v) * 1000,
            "p90_ms": _quantile(v, 0.9) * 1000,
            "mean_ms": statistics.fmean(v) * 1000,
            "requests": len(v),
        }
        for name, v in by_path.items()
    }
    report["gateway_minus_direct_median_ms"] = report["gateway"]["median_ms"] - report["direct"]["median_ms"]
    report["median_of_paired_differences_ms"] = statistics.median(g - d for g, d in pairs) * 1000
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "api_key"}
    return report


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    gateway = GatewayConfig.from_env()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=default_url(), help="Triton gRPC host:port")
    p.add_argument("--openai-url", default=gateway.url, help="the gateway's base URL")
    p.add_argument("--api-key", default=gateway.api_key)
    p.add_argument("--model", default=gateway.model)
    p.add_argument("--requests", type=int, default=25, help="measured pairs per worker (after one warm-up)")
    p.add_argument("--concurrency", type=int, default=8, help="workers: streams in flight on each path")
    p.add_argument("--input-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    report = asyncio.run(run(args))
    for name in ("direct", "gateway"):
        r = report[name]
        print(
            f"{name:<8} TTFT median {r['median_ms']:7.1f} ms  p90 {r['p90_ms']:7.1f} ms  mean {r['mean_ms']:7.1f} ms"
            f"  ({r['requests']} requests)"
        )
    print(
        f"gateway - direct, median TTFT: {report['gateway_minus_direct_median_ms']:+.1f} ms; median of the paired "
        f"differences: {report['median_of_paired_differences_ms']:+.1f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
