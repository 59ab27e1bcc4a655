"""What the tests and benchmarks share and users never need: tiny and wider variants of the
presets (`variants`). Nothing in the package imports it."""
