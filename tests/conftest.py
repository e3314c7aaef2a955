"""Shared fixtures: the suite's own cache directory, real model weights (the embedded SmolLM2 GGUF, tiny random HF
checkpoints) and engines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from neo_backend import EngineConfig, LLMEngine
from neo_backend.models.loader import default_model_path


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory) -> Iterator[Path]:
    """The suite's own cache directory, for in-process engines and the servers it starts (they inherit
    XDG_CACHE_HOME): performance profiles are measured afresh each run, so a profile taken once on a busy machine
    cannot steer every later run. Tokenizer conversions are deterministic and slow (~15 s): those stay shared with
    the user's cache."""
    user_tokenizers = EngineConfig().cache_path / "tokenizers"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        cache = EngineConfig().cache_path
        cache.mkdir()
        with contextlib.suppress(OSError):  # an unwritable user cache: convert into the suite's own
            user_tokenizers.mkdir(parents=True, exist_ok=True)
            (cache / "tokenizers").symlink_to(user_tokenizers, target_is_directory=True)
        yield cache


TINY_VARIANTS = {
    # GQA 4/2 with llama3 rope scaling, untied embeddings
    "llama3": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
}


def _make_tiny(directory: Path, variant: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_VARIANTS[variant])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        **spec,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    _tiny_tokenizer().save_pretrained(directory)
    return directory


def _tiny_tokenizer():
    """A real byte-level BPE tokenizer trained here on a small corpus, so tiny models need nothing else."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Paris is the capital of France.",
        "def add(a, b): return a + b",
        "Once upon a time, in a small village, there lived a cat.",
    ] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {v: _make_tiny(root / v, v) for v in TINY_VARIANTS}


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_gpu_blocks=1024, max_num_seqs=32, cpu_kv_cache_gb=0.25))


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32
    )
    return model.eval()
