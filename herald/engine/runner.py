"""ModelRunner: one batched forward of a model, replayed from piecewise CUDA graphs where allowed.

Both engines run every decode forward through here. On CUDA (``use_cuda_graph``), the first
forward of each input shape runs eagerly, the second captures piecewise graphs
(:class:`~herald.engine.cuda_graph.PiecewiseGraphForward`, everything but attention) and every
later one replays them; elsewhere every forward is eager.
"""

from __future__ import annotations

import torch

from herald.attention.base import AttentionBackend
from herald.engine.cuda_graph import PiecewiseGraphForward
from herald.models.base import BlockDiffusionLM


class ModelRunner:
    """Forwards of ``model`` through an attention backend the caller prepared."""

    def __init__(self, model: BlockDiffusionLM, *, use_cuda_graph: bool, is_moe: bool) -> None:
        self.model = model
        param = next(model.parameters())
        # The MoE reference path (non-bf16 MoE models) synchronises with the host and cannot be
        # captured; the fused and grouped_mm paths (bf16 on CUDA) and dense FFNs are graph-safe.
        graph_safe = not is_moe or param.dtype == torch.bfloat16
        self.use_cuda_graph = use_cuda_graph and param.device.type == "cuda" and graph_safe
        self._graphs: dict[tuple[int, int], PiecewiseGraphForward] = {}
        self._eager: set[tuple[int, int]] = set()
        self.forwards: dict[tuple[int, int], int] = {}
        """Forwards run per input shape ``(bs, length)``, graphs or not (the start-up warm-up
        reports the batch sizes it reached)."""

    @property
    def num_graph_shapes(self) -> int:
        """Input shapes with captured graphs."""
        return len(self._graphs)

    def release(self) -> None:
        """Drop the captured graphs (and their memory pools) now, not whenever the garbage
        collector gets to them."""
        self._graphs.clear()
        self._eager.clear()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Final-normed hidden states ``[bs, L, hidden]`` (a graph's static buffer when replayed:
        valid until the next forward of that shape)."""
        key = (input_ids.shape[0], input_ids.shape[1])
        self.forwards[key] = self.forwards.get(key, 0) + 1
        if not self.use_cuda_graph:
            return self.model(input_ids, positions, attn)
        runner = self._graphs.get(key)
        if runner is None:
            if key not in self._eager:
                # NOTE: one eager forward per new shape before capture: cuBLAS / cuDNN handles
                # and workspaces, and torch.compile's kernels for this shape, must exist before
                # capture. It is this step's real forward.
                self._eager.add(key)
                return self.model(input_ids, positions, attn)
            runner = self._graphs[key] = PiecewiseGraphForward(self.model, *key)
        return runner.forward(input_ids, positions, attn)
