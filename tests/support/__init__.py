"""Test-only plumbing, imported as ``tests.support.<module>``: compile-state control and graph
capture, cache comparisons and snapshots, and the oracle bounds the tests hold steps to."""
