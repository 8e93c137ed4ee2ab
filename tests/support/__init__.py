"""Test-only plumbing, imported as ``tests.support.<module>``: compile-state control and graph
capture, cache comparisons and snapshots, the oracle bounds the tests hold steps to, and the
benchmark scripts loaded for their smoke tests."""
