"""SwiGLU feed-forward with a fused gate/up projection (docs/MODELS.md §1, §4, §5).

``down(silu(gate(x)) * up(x))``. The checkpoint's separate ``gate_proj`` [I, H] and ``up_proj``
[I, H] are stored as the two row halves of one ``gate_up_proj`` [2I, H] (one matmul instead of two);
the loader maps the names (``herald.models`` weight specs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from herald.layers.fusion import cuda_compiled
from herald.layers.linear import Linear


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP: [..., hidden] -> [..., hidden], no biases, model dtype throughout."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=False, dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x)))


@cuda_compiled
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
