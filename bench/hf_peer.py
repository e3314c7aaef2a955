"""A peer on the same GPU: Hugging Face transformers against the engine on one offline workload.

    python bench/hf_peer.py --tokenizer "$TOKENIZER" --json hf_peer.json     # Llama-3-8B shape, bf16, CUDA
    python bench/hf_peer.py --device cpu --model /tmp/tiny --num-requests 4 --prompt-len 32 --output-len 8

The workload: --num-requests prompts of --prompt-len random token ids (seeded), all submitted at once, each
generating exactly --output-len tokens greedily (EOS ignored). Both sides use random weights of the same shape
(--model: a config dir; the engine loads it with load_format dummy, transformers with `from_config`).
Output tokens/s = generated tokens / wall seconds from submission to the last token, prefill included.

Systems, run in this order (the transformers model is freed before the engine starts):
  hf_generate        transformers static batching: `model.generate` on one [N, P] batch (halved on OOM),
                     min_new_tokens = max_new_tokens so EOS cannot end a row early
  hf_generate_batch  transformers continuous batching: the manager behind `generate_batch`
                     (`model.continuous_batching_context_manager`, paged attention, no EOS); its setup (KV
                     cache, CUDA-graph warm-up) is timed apart, as the engine's construction is
  neo                this engine: `LLMEngine.generate`, offload policy never unless --offload-policy says
Each system runs a small warm-up batch before the timed one. A system that fails records its error in the
JSON (written after each system) and the others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import LLAMA3_8B  # noqa: E402

from neo_backend import EngineConfig, LLMEngine  # noqa: E402
from neo_backend.executor.model_runner import resolve_device, resolve_dtype  # noqa: E402
from neo_backend.models.loader import load_tokenizer, read_model_config, resolve_source  # noqa: E402
from neo_backend.timing import sync  # noqa: E402

SYSTEMS = ("hf_generate", "hf_generate_batch", "neo")
WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 16, 4


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def prompt_vocab(config: EngineConfig) -> int:
    """Ids the engine's tokenizer can decode and the model can embed (the engine detokenizes prompts)."""
    source = resolve_source(config)
    model_cfg = read_model_config(source)
    return min(model_cfg.vocab_size, len(load_tokenizer(source, config, model_cfg)))


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def hf_model(model_dir: str, device: torch.device, dtype: torch.dtype):
    """Random weights of the config's shape, initialized on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def run_manager(manager, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(wall seconds, generated tokens) of one batch of requests through a running continuous-batching manager."""
    start = time.perf_counter()
    request_ids = manager.add_requests(prompts, max_new_tokens=output_len)
    finished = {}
    while len(finished) < len(request_ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(
                    f"the generation thread stopped after {len(finished)} of {len(request_ids)} requests"
                )
            continue
        if result.error:
            raise RuntimeError(f"request {result.request_id}: {result.error}")
        if result.is_finished():
            finished[result.request_id] = result
    return time.perf_counter() - start, sum(len(r.generated_tokens) for r in finished.values())


def cb_config(model, prompts: list[list[int]], output_len: int):
    """Defaults (KV cache and batch sized from free GPU memory) on CUDA; on CPU, just the blocks the workload
    needs and the engine's default token budget (the defaults size both from host RAM, tens of GB)."""
    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig()
    if model.device.type == "cpu":
        page = getattr(config, "page_size", None) or config.block_size  # renamed page_size after 5.17
        blocks_per_request = -(-(max(map(len, prompts)) + output_len) // page) + 1
        config.num_blocks = len(prompts) * blocks_per_request
        config.max_batch_tokens = EngineConfig.max_num_batched_tokens
    return config


def hf_generate_batch(model, prompts: list[list[int]], output_len: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # eos_token_id -1: no EOS, every request stops at max_new_tokens (see RequestState in transformers 5.x)
    gen_config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)), max_generated_length=output_len, num_requests=len(prompts)
    )
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config(model, prompts, output_len),
        workload_hints=hints,
        warmup=model.device.type == "cuda",
    ) as manager:
        setup_s = time.perf_counter() - start
        attn_implementation = model.config._attn_implementation
        run_manager(manager, [p[:WARMUP_PROMPT_LEN] for p in prompts[:2]], WARMUP_OUTPUT_LEN)
        wall_s, tokens = run_manager(manager, prompts, output_len)
    return {"wall_s": wall_s, "output_tokens": tokens, "setup_s": setup_s, "attn_implementation": attn_implementation}


def generate_static(model, prompts: torch.Tensor, output_len: int) -> int:
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=0,
    )
    return out.shape[0] * (out.shape[1] - prompts.shape[1])


def hf_generate(model, prompts: list[list[int]], output_len: int) -> dict:
    """`generate` on all prompts as one batch; on out-of-memory, in sub-batches of half the size."""
    ids = torch.tensor(prompts, device=model.device)
    generate_static(model, ids[:2, :WARMUP_PROMPT_LEN], WARMUP_OUTPUT_LEN)
    batch = len(prompts)
    while True:
        try:
            start = time.perf_counter()
            tokens = sum(generate_static(model, ids[i : i + batch], output_len) for i in range(0, len(prompts), batch))
            sync(model.device)
            return {"wall_s": time.perf_counter() - start, "output_tokens": tokens, "batch_size": batch}
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            release_memory(model.device)


def neo(config: EngineConfig, prompts: list[list[int]], output_len: int) -> dict:
    start = time.perf_counter()
    engine = LLMEngine(config)
    setup_s = time.perf_counter() - start
    params = {"temperature": 0, "ignore_eos": True}
    engine.generate([p[:WARMUP_PROMPT_LEN] for p in prompts[:2]], {**params, "max_tokens": WARMUP_OUTPUT_LEN})
    start = time.perf_counter()
    outputs = engine.generate(prompts, {**params, "max_tokens": output_len})
    wall_s = time.perf_counter() - start
    return {
        "wall_s": wall_s,
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "setup_s": setup_s,
        "offload_policy": config.offload_policy,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def attempt(name: str, run: Callable[[], dict]) -> dict:
    """One system's figures, or its error (the other systems still run)."""
    try:
        result = run()
    except Exception as exc:  # recorded in the report, not fatal
        logging.exception("%s failed", name)
        return {"error": error_text(exc)}
    result["tok_s"] = result["output_tokens"] / result["wall_s"]
    return result


def run_hf(
    names: list[str],
    config: EngineConfig,
    prompts: list[list[int]],
    output_len: int,
    report: dict,
    json_path: Path | None,
) -> None:
    """The transformers systems on one model, freed afterwards."""
    runners = {"hf_generate": hf_generate, "hf_generate_batch": hf_generate_batch}
    device = torch.device(config.device)
    try:
        model = hf_model(config.model, device, resolve_dtype(config, device))
    except Exception as exc:  # every transformers system records it
        logging.exception("building the transformers model failed")
        report["systems"].update({name: {"error": error_text(exc)} for name in names})
        return
    for name in names:
        report["systems"][name] = attempt(name, partial(runners[name], model, prompts, output_len))
        release_memory(device)
        write_report(json_path, report)
    del model
    release_memory(device)


def run_systems(args: argparse.Namespace, config: EngineConfig, prompts: list[list[int]], report: dict) -> None:
    """Runs the chosen systems in SYSTEMS order, writing the report after each."""
    hf_names = [name for name in SYSTEMS if name.startswith("hf_") and name in args.systems]
    if hf_names:
        run_hf(hf_names, config, prompts, args.output_len, report, args.json)
    if "neo" in args.systems:
        report["systems"]["neo"] = attempt("neo", partial(neo, config, prompts, args.output_len))
        write_report(args.json, report)


def summarize(report: dict) -> None:
    """Adds the headline figures: each system's tok/s and the engine over the better transformers system."""
    systems = report["systems"]
    for name in SYSTEMS:
        report[f"{name}_tok_s"] = systems.get(name, {}).get("tok_s")
    hf_best = max((v for v in (report["hf_generate_batch_tok_s"], report["hf_generate_tok_s"]) if v), default=None)
    report["over_hf_transformers"] = report["neo_tok_s"] / hf_best if report["neo_tok_s"] and hf_best else None


def write_report(path: Path | None, report: dict) -> None:
    if path:
        path.write_text(json.dumps(report, indent=1))


def print_table(report: dict) -> None:
    print(f"{'system':18s} {'tokens':>8s} {'wall s':>8s} {'tok/s':>9s} {'setup s':>8s}  note")
    for name, r in report["systems"].items():
        if "error" in r:
            print(f"{name:18s} {'-':>8s} {'-':>8s} {'-':>9s} {'-':>8s}  {r['error'][:200]}")
            continue
        setup = f"{r['setup_s']:.1f}" if "setup_s" in r else "-"
        note = "" if r["output_tokens"] == report["expected_output_tokens"] else "token count differs from N*O"
        print(f"{name:18s} {r['output_tokens']:8d} {r['wall_s']:8.2f} {r['tok_s']:9.1f} {setup:>8s}  {note}")


def fmt(value: float | None) -> str:
    return "null" if value is None else f"{value:.4g}"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's knobs from the flags; both sides share the model dir, device and dtype."""
    if args.model is None:
        args.model = LLAMA3_8B
    args.load_format = args.load_format or "dummy"
    args.offload_policy = args.offload_policy or "never"
    args.max_num_seqs = args.max_num_seqs or max(256, args.num_requests)
    config = EngineConfig.from_cli_args(args)
    return dataclasses.replace(config, device=resolve_device(config).type)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)
    prompts = make_prompts(args.num_requests, args.prompt_len, prompt_vocab(config), args.seed)
    report = {
        "device": config.device,
        "model": config.model,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "expected_output_tokens": args.num_requests * args.output_len,
        "systems": {},
    }
    if config.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    import transformers

    report["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    run_systems(args, config, prompts, report)
    summarize(report)
    write_report(args.json, report)
    print_table(report)
    print(
        f"neo_tok_s={fmt(report['neo_tok_s'])} hf_generate_batch_tok_s={fmt(report['hf_generate_batch_tok_s'])} "
        f"hf_generate_tok_s={fmt(report['hf_generate_tok_s'])} "
        f"over_hf_transformers={fmt(report['over_hf_transformers'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
