"""Per-request records: one JSON line per request, written by the locust user, read by the report.

Locust rounds the response times it keeps to about two significant digits above 100 ms, which is too coarse
for per-token latencies, so the summary and chart come from these exact records; locust's own CSVs are written
beside them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO


@dataclass
class RequestRecord:
    start: float  # Unix time the request was sent
    end: float  # Unix time it finished or failed
    ok: bool
    ttft: float | None = None  # seconds
    tpot: float | None = None  # seconds, mean after the first token
    e2e: float | None = None  # seconds
    input_tokens: int | None = None  # as counted by the server
    output_tokens: int = 0
    error: str | None = None


class RecordWriter:
    """Appends records to a JSONL file, one line at a time so a killed run keeps what it measured."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._file.write(json.dumps(asdict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> Iterator[RequestRecord]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield RequestRecord(**json.loads(line))
