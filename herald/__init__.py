"""herald: a serving system for block diffusion LLMs (block dLLMs).

The full KV cache lives in CPU memory, the critical KV is selected on the CPU once per block, and
denoising runs on the GPU over a small sparse KV pool. See ``docs/ARCHITECTURE.md`` for the map.
"""

__version__ = "0.1.0"
