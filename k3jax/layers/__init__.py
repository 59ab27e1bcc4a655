"""Flax Linen layers, one file per kind."""
