"""What the tests, the benchmarks and the demo share, shipped with the package: seeded input
factories and goldens (``attn_inputs``, ``cache_inputs``, ``compress_index``), the oracle recorder
that feeds an engine and compares its steps with the cache-free oracle (``oracle_recorder``), a
``transformers`` DeepSeek V4 model with seeded random weights built on its device
(``random_model``), and the benchmarks' case type, CUDA-graph timing and flop / byte counts
(``bench``). It imports the runtime modules; they never import it. Test-only plumbing lives under
``tests/support``."""
