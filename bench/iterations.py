"""Where a serving run's iterations went: the iteration log of `bench/serving.py --iteration-log FILE`, grouped.

    python bench/iterations.py FILE                       # every run in the log: its iterations by kind
    python bench/iterations.py FILE --run auto --timeline 5   # runs whose label starts 'auto', and 5-s windows

Per run (policy and rate), a markdown table of its iterations by kind (mode, a prefill or not, GPU decode rows,
CPU decode rows), largest total time first: count, total, median measured and predicted step time, the host
attention's median and p90, and the engine thread's scheduling time between steps (of which swaps). With
`--timeline S`, per window of S seconds: iterations, mean waiting prompts, rows on each side, requests in the
host pool, prefills, and the median performance-model corrections: where a queue built and what the scheduler
did meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import pct  # noqa: E402


def read_runs(path: Path, prefix: str = "") -> dict[str, list[dict]]:
    """The log's rows by run label, in order; only runs whose label starts with `prefix`."""
    runs: dict[str, list[dict]] = defaultdict(list)
    with path.open() as lines:
        for line in lines:
            row = json.loads(line)
            if row["run"].startswith(prefix):
                runs[row["run"]].append(row)
    return dict(runs)


def kind(row: dict) -> tuple[str, bool, int, int]:
    return row["mode"], row["prefill_tokens"] > 0, row["gpu_decodes"], row["cpu_decodes"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def _total(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows)


def kinds_table(rows: list[dict], top: int) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[kind(row)].append(row)
    lines = [
        "| mode | prefill | GPU / CPU decodes | iterations | total s | measured ms | predicted ms "
        "| host attention median / p90 ms | scheduling (swaps) ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    totals = {k: _total(group, "measured_s") for k, group in groups.items()}
    for mode, prefill, gpu, cpu in sorted(totals, key=totals.get, reverse=True)[:top]:
        group = groups[mode, prefill, gpu, cpu]
        host = [r["measured_cpu_s"] for r in group]
        lines.append(
            f"| {mode} | {'yes' if prefill else ''} | {gpu} / {cpu} | {len(group)} "
            f"| {totals[mode, prefill, gpu, cpu]:.1f} | {_ms(_median(group, 'measured_s'))} "
            f"| {_ms(_median(group, 'predicted_s'))} "
            f"| {f'{_ms(statistics.median(host))} / {_ms(pct(host, 90))}' if cpu else ''} "
            f"| {_ms(_median(group, 'schedule_s'))} ({_ms(_median(group, 'swap_s'))}) |"
        )
    return lines


def timeline(rows: list[dict], window_s: float) -> list[str]:
    windows: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        windows[int((row["t"] - rows[0]["t"]) // window_s)].append(row)
    lines = [
        "| from s | iterations | waiting | GPU / CPU decodes | in host pool | prefills | cpu_correction "
        "| offload_slowdown |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, group in sorted(windows.items()):
        lines.append(
            f"| {index * window_s:g} | {len(group)} | {_mean(group, 'requests_waiting'):.1f} "
            f"| {_mean(group, 'gpu_decodes'):.1f} / {_mean(group, 'cpu_decodes'):.1f} "
            f"| {_mean(group, 'requests_cpu_decode'):.1f} | {sum(1 for r in group if r['prefill_tokens'])} "
            f"| {_median(group, 'cpu_correction'):.2f} | {_median(group, 'offload_slowdown'):.2f} |"
        )
    return lines


def summary(label: str, rows: list[dict]) -> str:
    last = rows[-1]
    return (
        f"{label.strip()}: {len(rows)} iterations over {last['t'] - rows[0]['t']:.1f} s, steps "
        f"{_total(rows, 'measured_s'):.1f} s, scheduling {_total(rows, 'schedule_s'):.2f} s "
        f"(swaps {_total(rows, 'swap_s'):.2f} s), decode rows GPU / CPU "
        f"{_total(rows, 'gpu_decodes')} / {_total(rows, 'cpu_decodes')}, preemptions "
        f"{last['preemptions_by_cause'] or 0}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="JSON lines of bench/serving.py --iteration-log")
    parser.add_argument("--run", default="", help="only runs whose label starts with this (e.g. 'auto')")
    parser.add_argument("--top", type=int, default=12, help="kinds shown per run, largest total time first")
    parser.add_argument("--timeline", type=float, metavar="S", help="also a table of S-second windows per run")
    args = parser.parse_args()
    runs = read_runs(args.log, args.run)
    if not runs:
        raise SystemExit(f"{args.log}: no run whose label starts with {args.run!r}")
    for label, rows in runs.items():
        print(summary(label, rows), "", *kinds_table(rows, args.top), "", sep="\n")
        if args.timeline:
            print(*timeline(rows, args.timeline), "", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
