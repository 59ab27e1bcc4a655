"""Pure functions the layers call (no parameters)."""
