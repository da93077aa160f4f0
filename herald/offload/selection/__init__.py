"""KV selection: the CPU kernel and its reference, GPU top-k, InfiniGen's proxy."""
