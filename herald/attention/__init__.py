"""Attention backends: what a decoder layer's queries see (:mod:`herald.attention.base`)."""
