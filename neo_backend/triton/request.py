"""What one Triton request asks for: the vLLM backend's inputs, TensorRT-LLM style scalars and request parameters.

A request is anything with `inputs()` (tensors with `name()` and `as_numpy()`) and `parameters()` (a JSON
string), as `pb_utils.InferenceRequest` has them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.sampling_params import SamplingParams
from ..errors import InvalidRequestError

FLAG_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
SCALAR_SAMPLING_INPUTS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# Request parameters that Triton's own frontends and clients set (e.g. tritonclient's
# enable_empty_final_response); they are not sampling parameters.
RESERVED_PARAMETER_PREFIX = "triton_"
RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output", "headers"}
)


@dataclass
class RequestSpec:
    """What one Triton request asks for, validated; parsing errors are InvalidRequestError naming the input."""

    prompt: str
    sampling: dict[str, Any]
    stream: bool
    exclude_input: bool
    returns: frozenset[str]  # the optional outputs asked for, by output name

    @classmethod
    def parse(cls, request: Any) -> RequestSpec:
        tensors = {tensor.name(): tensor for tensor in request.inputs()}
        prompt = _text_input(tensors)
        params = _json_object(request.parameters() or "{}", "the request parameters")
        params = {
            k: v
            for k, v in params.items()
            if k not in RESERVED_PARAMETERS and not k.startswith(RESERVED_PARAMETER_PREFIX)
        }
        flags = {name: _flag(tensors.get(name), name, params.pop(name, None)) for name in FLAG_INPUTS}
        stream = bool(flags["stream"])
        exclude = flags["exclude_input_in_output"]
        if stream and exclude is False:
            raise InvalidRequestError(
                "stream=true requires exclude_input_in_output=true: streamed responses carry only the new text"
            )
        tensor = tensors.get("sampling_parameters")
        sampling = (
            params
            if tensor is None
            else _json_object(_single_string(tensor, "sampling_parameters"), "sampling_parameters")
        )
        sampling = {**SamplingParams.parse_strings(sampling), **_scalar_sampling_inputs(tensors)}
        returns = frozenset(
            name[len("return_") :] for name in FLAG_INPUTS if name.startswith("return_") and flags[name]
        )
        # Like the vLLM backend: the prompt is prepended to a non-streamed answer unless excluded.
        return cls(prompt, sampling, stream, stream if exclude is None else exclude, returns)


def _text_input(tensors: Mapping[str, Any]) -> str:
    tensor = tensors.get("text_input")
    if tensor is None:
        raise InvalidRequestError("missing input text_input (the prompt, STRING[1])")
    return _single_string(tensor, "text_input")


def _single_string(tensor: Any, name: str) -> str:
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one string, got {values.size}")
    return _utf8(values[0], name)


def _utf8(value: Any, name: str) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(f"{what} nests too deeply to be read") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _flag(tensor: Any | None, name: str, parameter: Any) -> bool | None:
    """A BOOL[1] input, or else the request parameter of the same name (as HTTP generate clients send it)."""
    if tensor is not None:
        values = tensor.as_numpy().reshape(-1)
        if values.size != 1:
            raise InvalidRequestError(f"{name} must hold exactly one boolean, got {values.size}")
        return bool(values[0])
    if parameter is None or isinstance(parameter, bool):
        return parameter
    raise InvalidRequestError(f"request parameter {name} must be a boolean, got {parameter!r}")


def _scalar_sampling_inputs(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """TensorRT-LLM style inputs (max_tokens INT32[1], temperature FP32[1], stop_words STRING[-1], ...)."""
    values: dict[str, Any] = {}
    for name in SCALAR_SAMPLING_INPUTS:
        tensor = tensors.get(name)
        if tensor is not None:
            array = tensor.as_numpy().reshape(-1)
            if array.size != 1:
                raise InvalidRequestError(f"{name} must hold exactly one value, got {array.size}")
            values[name] = array[0].item()
    tensor = tensors.get("stop_words")
    if tensor is not None:
        values["stop"] = [_utf8(v, "stop_words") for v in tensor.as_numpy().reshape(-1)]
    return values
