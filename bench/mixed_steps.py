"""What the steps that mix a prompt's prefill with decodes lose to the host, and what CUDA graphs would give them.

    python bench/mixed_steps.py --tokenizer DIR --json bench/results/<gpu>_mixed_steps.json

Llama-3-8B shape, dummy bf16 weights, `never`, on CUDA. Decode-only steps replay the engine's captured graphs;
a step that also prefills replays its mixed-step pieces up to `MIXED_MAX_ROWS` rows and launches a kernel at a
time beyond. Two parts, for decode batches of 64 and 8 (context ~1024) beside one new prompt of 16 to 1024 tokens:
- the forward alone: eager (launched and waited for), against the same forward captured in one CUDA graph and
  replayed (the device's own time), and the host's time to launch the eager forward without waiting; where the
  step fits the engine's mixed-step graphs (`MixedGraphs`: pieces between eager attentions), those too;
- the engine: the device time of its mixed steps (from their first kernel to their samples' copy, which counts
  the device waiting for launches), with the pieces and eager in alternation, against its decode-only steps;
  and the wall-clock time a step of streaks of mixed steps, a new prompt every step (where the host's launches
  cannot hide behind a decode-only step's replay).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import llama3_8b_args, placed_sequence  # noqa: E402

from neo_backend import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from neo_backend.core.sequence import Placement, Sequence  # noqa: E402
from neo_backend.executor.cuda_graphs import capture  # noqa: E402
from neo_backend.timing import median_seconds  # noqa: E402

DECODE_BATCHES = (64, 8)
PROMPTS = (16, 64, 256, 1024)
CONTEXT = 1024
REPEATS = 4  # mixed steps measured in the engine per (batch, prompt)
STREAK = 6  # back-to-back mixed steps, a new prompt each, per streak (two streaks a mode)


def forward_alone(engine: LLMEngine, batch: int, prompt: int) -> dict:
    """ms of the mixed forward eager, as one graph, and to launch eagerly; the decode rows alone as one graph."""
    runner = engine.runner
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    rng = random.Random(batch * 7 + prompt)
    per_seq = CONTEXT // runner.block_size
    blocks = rng.sample(range(runner.num_gpu_blocks), batch * per_seq + -(-prompt // runner.block_size))
    decodes = [
        placed_sequence(f"d{i}", CONTEXT, blocks[i * per_seq : (i + 1) * per_seq], Placement.GPU, vocab)
        for i in range(batch)
    ]
    new = Sequence("p", None, [rng.randrange(vocab) for _ in range(prompt)], SamplingParams(temperature=0))
    new.block_table = blocks[batch * per_seq :]
    result = {"decode_batch": batch, "prompt": prompt}
    for name, prefills in (("mixed", [(new, prompt)]), ("decode", [])):
        sub = runner.prepare(prefills, decodes, []).sub

        def forward(sub=sub) -> torch.Tensor:
            return runner.model(sub.input_ids, sub.positions, sub.meta)

        if name == "mixed":
            result["mixed_eager_ms"] = median_seconds(forward, 10, device=runner.device, warmup=2) * 1e3
            result["mixed_launch_ms"] = launch_seconds(forward, runner.device) * 1e3
            pieces = runner.mixed_graphs
            if pieces is not None and pieces.fits(sub.input_ids.numel()):

                def replayed(sub=sub) -> torch.Tensor:
                    return pieces.run(sub.input_ids, sub.positions, sub.meta)

                result["mixed_pieces_ms"] = median_seconds(replayed, 10, device=runner.device, warmup=2) * 1e3
                result["mixed_pieces_launch_ms"] = launch_seconds(replayed, runner.device) * 1e3
        graph, _ = capture(forward, None)
        result[f"{name}_graph_ms"] = median_seconds(graph.replay, 10, device=runner.device, warmup=2) * 1e3
        del graph
    return result


def launch_seconds(forward, device: torch.device, reps: int = 10) -> float:
    """Host seconds to launch `forward` without waiting for its kernels, the mean of `reps` back to back."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        forward()
    seconds = (time.perf_counter() - start) / reps
    torch.cuda.synchronize(device)
    return seconds


def in_engine(engine: LLMEngine, batch: int) -> list[dict]:
    """Per prompt length, the median device ms of the engine's mixed steps (with the pieces and eager) and of the
    decode-only steps beside, and the wall-clock ms a step of streaks of mixed steps in either mode."""
    rng = random.Random(batch)
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    steps_needed = 4 + len(PROMPTS) * (REPEATS * 2 * 4 + 2 * 2 * (STREAK + 4))
    for _ in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(CONTEXT - steps_needed // 2)]
        engine.add_request(prompt, {"max_tokens": 2 * steps_needed, "temperature": 0, "ignore_eos": True})
    records: list[dict] = []
    last = engine.counters.last_iteration

    def step() -> None:
        nonlocal last
        engine.step()
        if engine.counters.last_iteration is not last:
            last = engine.counters.last_iteration
            records.append(last)

    def settle() -> None:
        """Step until a step carries the decodes alone and no prompt waits: none left from what came before."""
        records.clear()
        while engine.scheduler.waiting or not (
            records and not records[-1]["prefill_tokens"] and records[-1]["gpu_decodes"] == batch
        ):
            step()

    pieces = engine.runner.mixed_graphs

    def add_prompt(tokens: int) -> None:
        """A new prompt that samples one token: its prefill is the mixed step."""
        engine.add_request([rng.randrange(vocab) for _ in range(tokens)], {"max_tokens": 1, "ignore_eos": True})

    def use(mode: str) -> None:
        engine.runner.mixed_graphs = pieces if mode == "pieces" else None

    settle()
    rows = []
    for prompt in PROMPTS:
        steps: dict[str, list[float]] = {"pieces": [], "eager": [], "decode": []}
        for _ in range(REPEATS):
            for mode in ("pieces", "eager"):
                use(mode)
                records.clear()
                add_prompt(prompt)
                for _ in range(4):
                    step()
                full = [r for r in records if r["gpu_decodes"] == batch]
                steps[mode] += [r["measured_s"] * 1e3 for r in full if r["prefill_tokens"]]
                steps["decode"] += [r["measured_s"] * 1e3 for r in full if not r["prefill_tokens"]]
        streaks: dict[str, list[float]] = {"pieces": [], "eager": []}
        for _ in range(2):
            for mode in ("pieces", "eager"):
                use(mode)
                start = time.perf_counter()
                for _ in range(STREAK):
                    add_prompt(prompt)
                    step()
                streaks[mode].append((time.perf_counter() - start) / STREAK * 1e3)
                settle()
        use("pieces")
        row = {"decode_batch": batch, "prompt": prompt, "mixed_steps": len(steps["pieces"])}
        for name, times in steps.items():
            row[f"{name}_step_ms"] = statistics.median(times) if times else None
        for name, times in streaks.items():
            row[f"{name}_streak_wall_ms"] = min(times)
        rows.append(row)
    while engine.has_unfinished_requests():
        engine.step()
    return rows


def main() -> int:
    args = llama3_8b_args(__doc__)
    # seats for a streak's prompts beside the largest decode batch: none waits for another to finish
    args.offload_policy, args.max_num_seqs = "never", max(args.max_num_seqs or 0, max(DECODE_BATCHES) + STREAK)
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    if engine.runner.device.type != "cuda":
        print("bench/mixed_steps.py needs a CUDA device")
        return 2
    result: dict = {"gpu": torch.cuda.get_device_name(engine.runner.device), "forward": [], "engine": []}
    with engine.runner.device_scope(), torch.inference_mode():
        for batch in DECODE_BATCHES:
            for prompt in PROMPTS:
                row = forward_alone(engine, batch, prompt)
                result["forward"].append(row)
                pieces = (
                    f", as the engine's pieces {row['mixed_pieces_ms']:.2f} ms (launching them "
                    f"{row['mixed_pieces_launch_ms']:.2f} ms)"
                    if "mixed_pieces_ms" in row
                    else ""
                )
                print(
                    f"forward, {batch} decodes + {prompt}-token prompt: eager {row['mixed_eager_ms']:.2f} ms "
                    f"(launching it {row['mixed_launch_ms']:.2f} ms), one graph {row['mixed_graph_ms']:.2f} ms"
                    f"{pieces}; the decodes alone, one graph {row['decode_graph_ms']:.2f} ms",
                    flush=True,
                )
        for batch in DECODE_BATCHES:
            for row in in_engine(engine, batch):
                result["engine"].append(row)
                print(
                    f"engine, {batch} decodes + {row['prompt']}-token prompt: mixed step {row['pieces_step_ms']} ms "
                    f"with the pieces against {row['eager_step_ms']} ms eager ({row['mixed_steps']} steps each), "
                    f"decode-only step {row['decode_step_ms']} ms; back to back, a new prompt every step: "
                    f"{row['pieces_streak_wall_ms']:.2f} ms a step with the pieces against "
                    f"{row['eager_streak_wall_ms']:.2f} eager (wall clock)",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
