"""herald: a serving system for block diffusion LLMs (block dLLMs).

The full KV cache lives in CPU memory, the critical KV is selected on the CPU once per block, and
denoising runs on the GPU over a small sparse KV pool. See ``docs/ARCHITECTURE.md`` for the map.
"""

from herald.onednn import bound_primitive_caches

# Before anything here can run a CPU matmul: oneDNN reads its cache capacities once, at its first
# call, and the default ones let a long-running CPU server grow by hundreds of MB (herald.onednn).
bound_primitive_caches()

__version__ = "0.1.0"
