"""The offloading engine: full KV in CPU memory, selection policies, the retrieval stream."""
