"""Safetensors I/O, name maps and checkpoint conversion."""
