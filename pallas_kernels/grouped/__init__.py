"""What the grouped-matmul kernels share: the megablox-style visit list over row tiles
(visits.py), the manual-axes typing of their outputs inside shard_map (manual.py), and
their fp32-accumulating product and block sizes (matmul.py)."""
