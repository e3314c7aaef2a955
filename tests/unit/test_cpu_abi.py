"""The binding's copy of the C ABI's numbers (neo_backend/cpu/abi.py) against kernels/abi.h, where they are
defined, so neither side can change one alone."""

from __future__ import annotations

import re
from enum import IntEnum

import pytest

from neo_backend.cpu import abi, library
from neo_backend.cpu.build import KERNEL_DIR

HEADER = (KERNEL_DIR / "abi.h").read_text()


def header_enum(name: str) -> dict[str, int]:
    """`enum <name> : int { ... };` of the header as {PYTHON_NAME: value}, implicit values counted on."""
    body = re.search(rf"enum {name} : int \{{([^}}]*)\}};", HEADER)
    assert body, f"kernels/abi.h has no enum {name}"
    values, value = {}, 0
    for entry in filter(None, (e.strip() for e in body.group(1).split(","))):
        key, _, given = (part.strip() for part in entry.partition("="))
        value = int(given) if given else value
        values[python_name(key)] = value
        value += 1
    return values


def header_constant(name: str) -> int:
    found = re.search(rf"constexpr \w+ {name} = (-?\d+);", HEADER)
    assert found, f"kernels/abi.h has no constant {name}"
    return int(found.group(1))


def python_name(c_name: str) -> str:
    """kHandOffTimedOut -> HAND_OFF_TIMED_OUT, kKNew -> K_NEW, kBF16 -> BF16."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", c_name.removeprefix("k"))
    return words.upper()


@pytest.mark.parametrize(
    "enum", [abi.DType, abi.Isa, abi.Status, abi.WaitStatus, abi.IterationStatus], ids=lambda e: e.__name__
)
def test_every_enum_matches_the_header(enum: type[IntEnum]):
    assert {member.name: member.value for member in enum} == header_enum(enum.__name__)


def test_the_step_fields_match_the_header():
    fields = header_enum("StepField")
    assert fields.pop("STEP_FIELDS") == len(abi.StepField), "kStepFields counts the fields"
    assert {member.name: member.value for member in abi.StepField} == fields


def test_the_constants_match_the_header():
    assert abi.ABI_VERSION == header_constant("kAbiVersion")
    assert abi.FLAG_FAILED == header_constant("kFlagFailed")


def test_every_dtype_has_a_torch_dtype():
    assert sorted(abi.DTYPE_CODES.values()) == list(abi.DType)


def test_the_supported_head_dims_are_those_the_kernel_is_instantiated_for():
    impl = (KERNEL_DIR / "attention_impl.h").read_text()
    dims = [int(d) for d in re.findall(r"case (\d+): return &Kernel<KT, \1>::process;", impl)]
    assert tuple(dims) == abi.SUPPORTED_HEAD_DIMS


def test_the_built_library_reports_the_abi_version():
    assert library.default().neo_abi_version() == abi.ABI_VERSION
