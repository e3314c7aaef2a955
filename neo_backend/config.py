"""Engine configuration: the one source of truth for every knob.

CLI flags (`add_cli_args`), Triton `config.pbtxt` parameters and `NEO_*` environment variables all map
onto `EngineConfig` through `EngineConfig.from_strings`, so a knob is declared, typed, defaulted and
validated exactly once, here. `parse_knob` is the one reading of a string as a typed value, also used for
sampling parameters sent as strings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, NeoError

OFFLOAD_POLICIES = ("auto", "never", "always")
PIPELINE_MODES = ("auto", "on", "off")
OVERLAP_MODES = ("auto", "on", "off")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cuda", "cpu")
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")


@dataclass
class EngineConfig:
    # Model
    model: str | None = field(
        default=None,
        metadata={
            "help": "HF model dir, .gguf file, or config dir for dummy weights; "
            "unset: the embedded SmolLM2-135M-Instruct"
        },
    )
    load_format: str = field(default="auto", metadata={"choices": LOAD_FORMATS})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer dir (default: the model's own)"})
    dtype: str = field(default="auto", metadata={"choices": DTYPES, "help": "auto: bfloat16 on CUDA, float32 on CPU"})
    device: str = field(default="auto", metadata={"choices": DEVICES})
    max_model_len: int | None = field(default=None, metadata={"help": "default: the model's max positions"})
    default_seed: int = field(default=0, metadata={"help": "seed of the sampler for requests without a seed"})
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks the model is sharded over (Megatron-style): this process is rank 0, the others are "
            "worker processes it starts; it must divide the attention and KV head counts"
        },
    )
    # Paged KV cache
    block_size: int = 16
    num_gpu_blocks: int | None = field(default=None, metadata={"help": "explicit GPU KV pool size in blocks"})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "fraction of device memory for weights, activations and the KV pool"}
    )
    gpu_sm_count: int | None = field(
        default=None,
        metadata={
            "help": "run every GPU operation on a partition of this many SMs (a CUDA green context; multiples of 8 "
            "on Hopper); unset: the whole GPU. Memory is not partitioned: pair it with num_gpu_blocks or "
            "gpu_memory_utilization"
        },
    )
    # Batching
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_queue_size: int = field(default=1024, metadata={"help": "waiting requests beyond which new ones are refused"})
    enforce_eager: bool = field(default=False, metadata={"help": "disable CUDA graphs (every step eager)"})
    overlap_steps: str = field(
        default="auto",
        metadata={
            "choices": OVERLAP_MODES,
            "help": "launch each step before the previous one's tokens are read back (the device feeds them to it) "
            "and make outputs while it runs; auto: on CUDA at tensor_parallel_size 1. Steps with requests on the "
            "host, swaps or penalties run one at a time",
        },
    )
    # NEO offload
    offload_policy: str = field(default="auto", metadata={"choices": OFFLOAD_POLICIES})
    cpu_kv_cache_gb: float = field(
        default=4.0, metadata={"help": "host KV pool size in GiB (every tensor-parallel rank's share together)"}
    )
    cpu_attention_threads: int | None = field(
        default=None,
        metadata={
            "help": "per rank; default: the cores this process may use (at tensor_parallel_size > 1, the rank's "
            "share of them), less one on CUDA (for the launching thread) or less engine_cpu where that is set"
        },
    )
    engine_cpu: int | None = field(
        default=None,
        metadata={
            "help": "pin the engine loop thread to this CPU and CPU attention to the others; with other processes "
            "kept off it, a busy host cannot slow the GPU path"
        },
    )
    pipeline: str = field(default="auto", metadata={"choices": PIPELINE_MODES})
    cpu_latency_slack: float = field(
        default=1.2,
        metadata={"help": "auto: an iteration with CPU work may take at most this times its GPU part alone"},
    )
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "converted tokenizers and performance profiles; default: $XDG_CACHE_HOME/neo-triton"},
    )
    # Per-request limits (admission control)
    max_prompt_bytes: int = 1 << 20
    max_tokens_cap: int = field(default=32768, metadata={"help": "largest max_tokens a request may ask for"})
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name}={getattr(self, f.name)!r} is not one of {', '.join(choices)}")
        positive = [
            "tensor_parallel_size",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queue_size",
            "max_prompt_bytes",
            "max_tokens_cap",
            "max_stop_strings",
            "max_stop_string_len",
        ]
        optional_positive = ["num_gpu_blocks", "max_model_len", "cpu_attention_threads", "gpu_sm_count"]
        for name in positive + [n for n in optional_positive if getattr(self, n) is not None]:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_latency_slack < 1.0:
            raise ConfigError(f"cpu_latency_slack must be >= 1, got {self.cpu_latency_slack}")
        if self.cpu_kv_cache_gb < 0:
            raise ConfigError(f"cpu_kv_cache_gb must be >= 0, got {self.cpu_kv_cache_gb}")
        if self.engine_cpu is not None and self.engine_cpu < 0:
            raise ConfigError(f"engine_cpu must be a CPU number >= 0, got {self.engine_cpu}")
        if self.overlap_steps == "on" and self.tensor_parallel_size > 1:
            raise ConfigError("overlap_steps=on needs tensor_parallel_size 1 (worker ranks run steps one at a time)")
        if self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    @property
    def cache_path(self) -> Path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(self.cache_dir) if self.cache_dir else Path(base) / "neo-triton"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_strings(
        cls, values: Mapping[str, str], base: EngineConfig | None = None, source: str = "parameter"
    ) -> EngineConfig:
        """Build a config from string values (Triton parameters, env vars); unknown keys are errors."""
        kwargs = dataclasses.asdict(base) if base else {}
        hints = typing.get_type_hints(cls)
        known = set(cls.field_names())
        for key, raw in values.items():
            if key not in known:
                raise ConfigError(f"unknown {source} {key!r}; known: {', '.join(sorted(known))}")
            kwargs[key] = parse_knob(key, raw, hints[key], source)
        return cls(**kwargs)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: EngineConfig | None = None) -> EngineConfig:
        """Read `NEO_<KNOB>` variables (e.g. NEO_OFFLOAD_POLICY=never); server ports are not knobs."""
        environ = os.environ if environ is None else environ
        known = set(cls.field_names())
        values = {
            k[4:].lower(): v for k, v in environ.items() if k.startswith("NEO_") and k[4:].lower() in known and v != ""
        }
        return cls.from_strings(values, base=base, source="environment variable")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "") + f" (default: {f.default})"
            if _base_type(hints[f.name]) is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                group.add_argument(flag, default=None, choices=f.metadata.get("choices"), help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        values = {name: getattr(args, name) for name in cls.field_names() if getattr(args, name, None) is not None}
        return cls.from_strings({k: str(v) for k, v in values.items()}, source="flag")

    def changed_knobs(self, base: EngineConfig | None = None) -> dict[str, Any]:
        """The knobs whose values differ from `base` (default: the defaults), in declaration order."""
        base = base or EngineConfig()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        }


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
NONE_WORDS = ("", "none", "null")


def parse_knob(key: str, raw: Any, hint: Any, source: str, error: type[NeoError] = ConfigError) -> Any:
    """`raw` (a string, or what `str()` makes of it) as a value of type `hint`; else `error` naming `source` and `key`.

    Surrounding spaces are ignored and words are read in any case: a bool is one of TRUE_WORDS or FALSE_WORDS,
    an optional type also takes one of NONE_WORDS for None, and any other type is built from the text (`int(text)`).
    """
    optional = type(None) in typing.get_args(hint)
    base = _base_type(hint)
    text = str(raw).strip()
    if optional and text.lower() in NONE_WORDS:
        return None
    try:
        if base is bool:
            if text.lower() in TRUE_WORDS:
                return True
            if text.lower() in FALSE_WORDS:
                return False
            raise ValueError
        return base(text)
    except ValueError:
        raise error(f"{source} {key}={raw!r} is not a valid {base.__name__}") from None


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2), read from HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] not in cls.SUPPORTED:
            raise ConfigError(f"architecture {archs[0]} is not supported; supported: {', '.join(cls.SUPPORTED)}")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = None
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", archs[0] == "Qwen2ForCausalLM")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
