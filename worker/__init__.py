"""The model worker: intake from Redis, batched decode steps with a KV cache, publishing."""
