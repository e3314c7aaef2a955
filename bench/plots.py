"""Figures and headline numbers of the GPU runs: one PNG per serving scenario and bench/results/h200.json.

    python bench/plots.py                          # the default inputs under bench/results/
    python bench/plots.py --serving-b-80gb $OUT/h200_serving_b_80gb.json --hf-peer $OUT/h200_hf_peer.json

Per scenario (the JSON of `bench/serving.py --json`): throughput in output tokens/s on x against the mean
per-token latency and the P99 TPOT on y, one curve per offload policy (as in the NEO paper's figures 9-10),
written to <out-dir>/<the input's name>.png; and `neo_over_gpu_only`, serving.py's ratio of the best
throughputs under the SLO, auto over never. Besides: `decode_step_over_floor` and
`prefill_fraction_of_matmul_peak` from `bench/engine.py --roofline --json`, and `over_hf_transformers` from
`bench/hf_peer.py --json`. A missing or unreadable input gives null with a note, not an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
SCENARIOS = {  # name: (default input, title)
    "a_24gb": (RESULTS / "h200_serving_a_24gb.json", "(a) emulated 24 GB GPU"),
    "b_80gb": (RESULTS / "h200_serving_b_80gb.json", "(b) emulated 80 GB GPU"),
    "c_full": (RESULTS / "h200_serving_c_full.json", "(c) full H200"),
    "d_a10g": (RESULTS / "h200_serving_d_a10g.json", "(d) emulated A10G: 8 of 132 SMs, 24 GB, Llama-3-8B shape"),
    "e_t4mem": (
        RESULTS / "h200_serving_e_t4mem.json",
        "(e) emulated T4 memory: 8 SMs (twice a T4's bandwidth), 16 GB, Llama-2-7B shape, steady state, slack 3",
    ),
    "e_t4mem_h100": (
        RESULTS / "h100_serving_e_t4mem.json",
        "(e) emulated T4 memory on an H100: 8 of 132 SMs, 16 GB, Llama-2-7B shape, steady state, slack 2",
    ),
    "e_t4mem_h100_slack3": (
        RESULTS / "h100_serving_e_t4mem_slack3.json",
        "(e) emulated T4 memory on an H100: 8 of 132 SMs, 16 GB, Llama-2-7B shape, steady state, slack 3, "
        "swaps waited for on the device",
    ),
    "e_t4mem_always": (
        RESULTS / "h200_serving_e_t4mem_always.json",
        "(e) emulated T4 memory, never against always: 8 SMs, 16 GB, Llama-2-7B shape",
    ),
}
LATENCY_AXES = (("mean_per_token_latency_s", "mean per-token latency (s)"), ("tpot_p99_s", "P99 TPOT (s)"))


def read_json(path: Path, notes: list[str]) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        notes.append(f"{path}: {type(exc).__name__}: {exc}")
        return None


def plot_scenario(report: dict, title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (key, label) in zip(axes, LATENCY_AXES):
        for index, (policy, rows) in enumerate(report["results"].items()):
            rows = sorted((r for r in rows if r.get(key) is not None), key=lambda r: r["rate"])
            (line,) = ax.plot(
                [r["output_tokens_per_s"] for r in rows], [r[key] for r in rows], marker="o", label=policy
            )
            for r in rows:  # the request rate of each point, as the curve may turn back
                ax.annotate(
                    f"{r['rate']:g}/s",
                    (r["output_tokens_per_s"], r[key]),
                    fontsize=7,
                    color=line.get_color(),
                    textcoords="offset points",
                    xytext=(4, 4 - 12 * index),
                )
        ax.set_xlabel("throughput (output tokens/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if report.get("slo_tpot_p99_s"):
        axes[1].axhline(report["slo_tpot_p99_s"], color="gray", linestyle="--", label="SLO")
    bound = (report.get("paper_metric") or {}).get("latency_bound_s")
    if bound:
        axes[0].axhline(bound, color="gray", linestyle="--", label="2x GPU-only at the lightest rate")
    for ax in axes:
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def neo_over_gpu_only(report: dict) -> float | None:
    """auto / never of the best throughputs under the SLO; None where either policy is missing or never met it."""
    return (report.get("ratios_over_never") or {}).get("auto")


def scenario_summary(name: str, path: Path, title: str, out_dir: Path) -> dict:
    notes: list[str] = []
    report = read_json(path, notes)
    summary = {"source": _shown(path), "neo_over_gpu_only": None}
    if report is not None:
        png = out_dir / f"{path.stem}.png"
        plot_scenario(report, title, png)
        summary.update(
            neo_over_gpu_only=neo_over_gpu_only(report),
            plot=_shown(png),
            paper_metric=report.get("paper_metric"),
            offline_ratios_over_never=report.get("offline_ratios_over_never"),
            slo_tpot_p99_s=report.get("slo_tpot_p99_s"),
            best_throughput_under_slo=report.get("best_throughput_under_slo"),
        )
        if summary["neo_over_gpu_only"] is None:
            notes.append("no auto/never ratio in the report (a policy missing, or never met the SLO)")
    if notes:
        summary["note"] = "; ".join(notes)
    return summary


def figure(path: Path, keys: tuple[str, ...], notes: list[str]) -> dict:
    """The named figures of one JSON report, null where the report or the figure is missing."""
    report = read_json(path, notes) or {}
    missing = [k for k in keys if report and report.get(k) is None]
    if missing:
        notes.append(f"{path}: no {', '.join(missing)}")
    return {k: report.get(k) for k in keys}


def _shown(path: Path) -> str:
    """A path as the JSON records it: relative to the repository when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (default, title) in SCENARIOS.items():
        parser.add_argument(
            f"--serving-{name.replace('_', '-')}",
            type=Path,
            default=default,
            dest=name,
            help=f"serving.py JSON of {title}",
        )
    parser.add_argument(
        "--roofline", type=Path, default=RESULTS / "h200_engine_roofline.json", help="bench/engine.py --roofline JSON"
    )
    parser.add_argument("--hf-peer", type=Path, default=RESULTS / "h200_hf_peer.json", help="bench/hf_peer.py JSON")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the PNGs and h200.json go")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    summary = {
        "scenarios": {
            name: scenario_summary(name, getattr(args, name), title, args.out_dir)
            for name, (_, title) in SCENARIOS.items()
        },
        **figure(args.roofline, ("decode_step_over_floor", "prefill_fraction_of_matmul_peak"), notes),
        **figure(args.hf_peer, ("over_hf_transformers",), notes),
        "sources": {"roofline": _shown(args.roofline), "hf_peer": _shown(args.hf_peer)},
    }
    if notes:
        summary["notes"] = notes
    out = args.out_dir / "h200.json"
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
