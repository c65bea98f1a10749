"""What the tests and the benchmarks both build: tiny models, LoRA adapters, a Redis Cluster, an
OTLP receiver. Here, not in tests/, so a benchmark imports nothing from the test suite."""
