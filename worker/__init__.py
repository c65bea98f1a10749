"""The model worker: intake from Redis, batched decode steps with a KV cache, publishing.

Four packages, each importing only those before it (tests/unit/test_layout.py checks it):
model/ (tensors and kernels: one forward over a step's batch), engine/ (scheduling, sampling and
the step loop), backends/ (the engines other than the paged one), service/
(the Redis side). main.py builds a worker from all four.
"""
