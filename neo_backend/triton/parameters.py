"""Engine knobs from the `parameters` of the model's config.pbtxt."""

from __future__ import annotations

from collections.abc import Mapping

from ..config import EngineConfig

# Read by the python backend itself, not engine knobs.
BACKEND_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})


def engine_config(parameters: Mapping[str, Mapping[str, str]]) -> EngineConfig:
    """EngineConfig from config.pbtxt `parameters`; unknown or malformed ones fail the model load, named."""
    values = {key: value.get("string_value", "") for key, value in parameters.items() if key not in BACKEND_PARAMETERS}
    return EngineConfig.from_strings(values, source="config.pbtxt parameter")
