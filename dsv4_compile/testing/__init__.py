"""Helpers shared by the tests and benchmarks: seeded builders and oracle checks."""
