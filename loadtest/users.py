"""What every locust user of the load test shares: its options, per-request records, closed- and open-loop
arrivals, and how a request is reported. A concrete user (locustfile.py: Triton gRPC; locust_openai.py: the
OpenAI API) only connects and sends one request.

Each request reports three locust entries: `TTFT` (time to first token), `TPOT` (mean time per output token
after the first) and `E2E` (whole request); a failed request is one `E2E` failure.

Closed loop (default): each user sends its next request when the previous one ends.
Open loop (`--rate R`): arrivals are a Poisson process of R requests/s shared by the users (each runs one of
R/users); a request starts at its arrival time whether or not earlier ones finished, up to `--max-in-flight`
per user, beyond which an arrival is counted as a failure (`backlog full`) instead of queueing in the client.

At the end of the run no request starts; those in flight finish (within `--request-timeout`) and are reported,
so a run's figures are not biased towards the requests short enough to end before it did.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import gevent
from gevent.pool import Pool
from locust import User, events, task
from locust.env import Environment
from locust.stats import CSV_STATS_INTERVAL_SEC

from client import ClientError, GenerationResult
from loadtest.records import RecordWriter, RequestRecord
from loadtest.workloads import WORKLOADS, RequestSpec, make_source

# A closed-loop user pauses this long after a failed request, so a dead server is not hammered in a tight loop.
FAILURE_BACKOFF_S = 1.0
_user_ids = itertools.count()
_records: RecordWriter | None = None


class BacklogFullError(ClientError):
    """An open-loop arrival found `--max-in-flight` requests of its user still running; it counts as failed."""


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:  # type: ignore[no-untyped-def]
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed", help="request length mix")
    parser.add_argument("--input-tokens", type=int, default=128, help="prompt tokens (fixed workload)")
    parser.add_argument("--output-tokens", type=int, default=64, help="output tokens (fixed workload)")
    parser.add_argument("--rate", type=float, default=0.0, help="open-loop Poisson arrivals/s (0: closed loop)")
    parser.add_argument("--max-in-flight", type=int, default=64, help="open loop: concurrent requests per user")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds allowed per request")
    parser.add_argument("--model", default="neo", help="model name")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request lengths")
    parser.add_argument("--records", default="", include_in_web_ui=False, help="JSONL file of per-request records")


@events.test_start.add_listener
def _open_records(environment: Environment, **_: object) -> None:
    global _records
    if environment.parsed_options and environment.parsed_options.records:
        _records = RecordWriter(Path(environment.parsed_options.records))


@events.quit.add_listener
def _let_the_csv_catch_up(**_: object) -> None:
    """locust rewrites its CSV files every CSV_STATS_INTERVAL_SEC and closes them at exit without a last
    write; `quit` fires after the users stopped and before that close, so one more interval makes the CSV
    final and equal to the records."""
    gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.25)


@events.test_stop.add_listener
def _close_records(**_: object) -> None:
    global _records
    if _records is not None:
        _records.close()
        _records = None


class StreamingUser(User):
    """One simulated user; subclasses set `request_type` and `request_errors` and implement the three hooks."""

    abstract = True
    request_type = ""
    request_errors: tuple[type[Exception], ...] = ()

    def connect(self) -> None:
        """Open the connection to `self.host` and check the model is ready."""
        raise NotImplementedError

    def disconnect(self) -> None:
        raise NotImplementedError

    def send(self, spec: RequestSpec) -> GenerationResult:
        """Stream one request to its end."""
        raise NotImplementedError

    def on_start(self) -> None:
        self.opts: Any = self.environment.parsed_options
        self.connect()
        user_id = next(_user_ids)
        self.source = make_source(
            self.opts.workload, self.opts.seed + user_id, self.opts.input_tokens, self.opts.output_tokens
        )
        self.arrivals = random.Random(f"arrivals-{self.opts.seed}-{user_id}")
        self.in_flight = Pool(self.opts.max_in_flight)

    def on_stop(self) -> None:
        self.in_flight.join(timeout=self.opts.request_timeout)
        self.in_flight.kill()  # past the timeout: each request cancels itself on the server as it unwinds
        self.disconnect()

    @task
    def generate(self) -> None:
        if self.opts.rate <= 0:
            # in the pool too, so that stopping this user lets the request finish
            if not self.in_flight.spawn(self._one_request).get():
                gevent.sleep(FAILURE_BACKOFF_S)
            return
        per_user_rate = self.opts.rate / max(1, self.environment.runner.user_count)
        gevent.sleep(self.arrivals.expovariate(per_user_rate))
        if self.in_flight.full():
            self._report_failure(
                time.time(),
                BacklogFullError(
                    f"open-loop backlog full ({self.opts.max_in_flight} in flight); lower --rate or add users"
                ),
            )
        else:
            self.in_flight.spawn(self._one_request)

    def _one_request(self) -> bool:
        """Send one request and report it; return whether it succeeded."""
        spec = self.source.next_request()
        start = time.time()
        try:
            result = self.send(spec)
        except self.request_errors as exc:
            self.source.observe(spec, None)
            self._report_failure(start, exc)
            return False
        self.source.observe(spec, result.text)
        self._report_success(start, result)
        return True

    def _report_success(self, start: float, result: GenerationResult) -> None:
        timings = (("TTFT", result.ttft, 0), ("TPOT", result.tpot, 0), ("E2E", result.e2e, result.num_output_tokens))
        for name, seconds, length in timings:
            if seconds is not None:
                self.environment.events.request.fire(
                    request_type=self.request_type,
                    name=name,
                    response_time=seconds * 1000,
                    response_length=length,
                    exception=None,
                    context={},
                )
        if _records is not None:
            _records.write(
                RequestRecord(
                    start=start,
                    end=start + result.e2e,
                    ok=True,
                    ttft=result.ttft,
                    tpot=result.tpot,
                    e2e=result.e2e,
                    input_tokens=result.num_input_tokens,
                    output_tokens=result.num_output_tokens,
                )
            )

    def _report_failure(self, start: float, exc: Exception) -> None:
        end = time.time()
        self.environment.events.request.fire(
            request_type=self.request_type,
            name="E2E",
            response_time=(end - start) * 1000,
            response_length=0,
            exception=exc,
            context={},
        )
        if _records is not None:
            _records.write(RequestRecord(start=start, end=end, ok=False, error=f"{type(exc).__name__}: {exc}"))
