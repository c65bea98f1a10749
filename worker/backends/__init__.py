"""The engines other than the paged one, behind worker/engine/backend.py's protocol: vLLM, static
batches (for architectures the paged runner does not serve) and the null engine (no model).

May import: shared/, worker/model/, worker/engine/ and this package.
"""
