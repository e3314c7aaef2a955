"""What sampling a step's tokens costs, with and without the penalties that read each request's tokens.

    python bench/sampler.py [--batch 64] [--vocab 128256] [--prompt-len 1000] [--output-len 1000]

One `Sampler` call (launch, then the read-back) over `batch` rows of random fp32 logits, per kind of request:
greedy, random (temperature 0.8), and random with a repetition penalty and with presence and frequency
penalties over `prompt-len` + `output-len` tokens of history. Prints the median milliseconds of each, its ratio
to random sampling without penalties, measured side by side in one process, and the penalties' own step
(`Sampler._apply_penalties`) timed alone.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from neo_backend import SamplingParams  # noqa: E402
from neo_backend.core.sequence import Sequence  # noqa: E402
from neo_backend.layers.sampler import Sampler  # noqa: E402
from neo_backend.timing import median_seconds  # noqa: E402

KINDS = {
    "greedy": dict(temperature=0),
    "random": dict(temperature=0.8),
    "random + repetition penalty": dict(temperature=0.8, repetition_penalty=1.1),
    "random + presence/frequency penalties": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3),
}


def sequences(batch: int, vocab: int, prompt_len: int, output_len: int, params: dict) -> list[Sequence]:
    rng = random.Random(0)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"r{i}", None, [rng.randrange(vocab) for _ in range(prompt_len)], SamplingParams(**params))
        seq.token_ids += [rng.randrange(vocab) for _ in range(output_len)]
        seqs.append(seq)
    return seqs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    logits = torch.randn(args.batch, args.vocab, device=device)
    sampler = Sampler((2,), seed=0)
    ms, penalties_ms = {}, {}
    for kind, params in KINDS.items():
        seqs = sequences(args.batch, args.vocab, args.prompt_len, args.output_len, params)
        ms[kind] = 1e3 * median_seconds(lambda: sampler(logits, seqs), args.reps, device=device, warmup=2)
        if seqs[0].params.has_penalties:
            penalties = lambda: sampler._apply_penalties(logits, seqs)  # noqa: E731
            penalties_ms[kind] = 1e3 * median_seconds(penalties, args.reps, device=device, warmup=2)
    print(f"{args.batch} rows, vocab {args.vocab}, {args.prompt_len} + {args.output_len} tokens each, {device}:")
    for kind, value in ms.items():
        alone = f"  (penalties alone {penalties_ms[kind]:.2f} ms)" if kind in penalties_ms else ""
        print(f"  {kind:40s} {value:8.2f} ms  {value / ms['random']:5.2f}x random{alone}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
