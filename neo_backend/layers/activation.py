import torch
from torch import nn

from . import fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: [T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    if fused.available(gate_up):
        return fused.silu_and_mul(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
