"""`python -m loadtest --duration 20s --users 8 [--rate R] [--workload fixed|a10g|conversation] [--api openai]`.

Runs locust headless (a subprocess, so its gevent patching stays out of this process) against the server
address from NEO_HOST/NEO_GRPC_PORT (or --url): Triton gRPC, or with `--api openai` the OpenAI gateway (its
address from NEO_OPENAI_HOST/NEO_OPENAI_PORT), then writes into the results directory:
  locust_stats.csv, locust_stats_history.csv, locust_failures.csv, locust_exceptions.csv  (locust's own)
  requests.jsonl  per-request records      summary.txt / summary.json  the table below
  latency.png     P50/P90/P99 of TTFT, TPOT and E2E over time
and prints the summary table as its last lines. Exit status 0 only when every request succeeded.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from client import ClientError, NeoClient, ServerUnreachableError, default_url
from openai_frontend import GatewayConfig

from .records import read_records
from .report import plot_percentiles_over_time, summarize, write_summary
from .workloads import WORKLOADS

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
LOCUSTFILES = {"triton": PACKAGE_DIR / "locustfile.py", "openai": PACKAGE_DIR / "locust_openai.py"}
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?$")


def duration_seconds(text: str) -> int:
    """Locust's duration syntax: 300, 20s, 5m, 1h30m."""
    match = _DURATION.match(text.strip())
    if not match or not any(match.groups()):
        raise argparse.ArgumentTypeError(f"bad duration {text!r}; use e.g. 20s, 5m, 1h30m or seconds")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", default="60s", help="run time, locust syntax (20s, 5m)")
    p.add_argument("--users", type=int, default=8, help="concurrent users (closed loop) or arrival streams")
    p.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second in total")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed")
    p.add_argument("--input-tokens", type=int, default=128, help="prompt tokens of the fixed workload")
    p.add_argument("--output-tokens", type=int, default=64, help="output tokens of the fixed workload")
    p.add_argument("--api", choices=LOCUSTFILES, default="triton", help="Triton gRPC, or the OpenAI gateway")
    p.add_argument(
        "--url",
        default=None,
        help=f"gRPC host:port (default from NEO_HOST/NEO_GRPC_PORT: "
        f"{default_url()}); with --api openai the gateway's base URL",
    )
    p.add_argument("--model", default="neo")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds allowed per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=PACKAGE_DIR / "results")
    args = p.parse_args(argv)
    args.duration_s = duration_seconds(args.duration)
    for name in ("users", "input_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate is not None and args.rate <= 0:
        p.error("--rate must be > 0 (leave it out for closed-loop users)")
    return args


def locust_command(args: argparse.Namespace, url: str) -> list[str]:
    results = args.results_dir
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILES[args.api]),
        "--headless",
        "--only-summary",
        "--users",
        str(args.users),
        "--spawn-rate",
        str(args.spawn_rate or args.users),
        "--run-time",
        f"{args.duration_s}s",
        "--host",
        url,
        "--csv",
        str(results / "locust"),
        "--csv-full-history",
        "--workload",
        args.workload,
        "--input-tokens",
        str(args.input_tokens),
        "--output-tokens",
        str(args.output_tokens),
        "--rate",
        str(args.rate or 0),
        "--request-timeout",
        str(args.request_timeout),
        "--model",
        args.model,
        "--seed",
        str(args.seed),
        "--records",
        str(results / "requests.jsonl"),
    ]


def check_ready(api: str, url: str, model: str) -> None:
    """Raise ClientError unless the server can take the load test's requests now."""
    if api == "triton":
        with NeoClient(url, model, timeout=10.0) as client:
            client.check_ready()
        return
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=10.0):
            pass
    except (urllib.error.URLError, OSError) as exc:
        raise ServerUnreachableError(
            f"the OpenAI gateway at {url} is not ready ({exc}); start it (make serve) or pass --url"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url or (GatewayConfig.from_env().url if args.api == "openai" else default_url())
    try:
        check_ready(args.api, url, args.model)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code

    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "requests.jsonl").unlink(missing_ok=True)
    # Users are stopped at the end of --run-time; the bound covers start-up and one request timeout more.
    limit = args.duration_s + args.request_timeout + 60
    try:
        locust = subprocess.run(locust_command(args, url), cwd=REPO_ROOT, stdout=sys.stderr, timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"error: locust did not stop within {limit:g} s", file=sys.stderr)
        return 1
    records_path = args.results_dir / "requests.jsonl"
    records = list(read_records(records_path)) if records_path.exists() else []
    if not records:
        print(
            f"error: locust (exit status {locust.returncode}) recorded no request; see its log above", file=sys.stderr
        )
        return 1

    mode = f"Poisson {args.rate:g} req/s" if args.rate else "closed loop"
    summary = summarize(
        records,
        f"neo load test: {args.workload} workload, {args.users} users, {mode}, "
        f"{args.duration_s} s against {url} ({args.api})",
    )
    write_summary(summary, args.results_dir)
    written = "locust_*.csv, requests.jsonl, summary.txt"
    try:
        plot_percentiles_over_time(records, args.results_dir / "latency.png")
        written += ", latency.png"
    except ImportError:
        print("warning: matplotlib is not installed (pip install -e '.[loadtest]'): no latency.png", file=sys.stderr)
    for error in summary.first_errors:
        print(f"failure: {error}", file=sys.stderr)
    sys.stderr.flush()
    print(f"results in {args.results_dir}/ ({written})")
    print(summary.table())
    return 0 if summary.errors == 0 and locust.returncode in (0, 1) else 1


if __name__ == "__main__":
    sys.exit(main())
