"""Fine-tuning and training: Per-Head Muon (muon.py), Quantile Balancing (balancing.py),
packed data (data.py), the jitted train step (step.py) and the run loop (loop.py)."""
