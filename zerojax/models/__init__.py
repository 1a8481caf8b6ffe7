"""Small reference models used by the examples, tests and benchmarks."""
