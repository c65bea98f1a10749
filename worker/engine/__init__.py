"""The engine: which requests run in each step and what comes out (the batcher, the fair queue, the
KV block manager, sequences, sampling, speculation, structured outputs, pooling), the step loop
(core.py: schedule, execute, postprocess) and the protocol every engine keeps (backend.py).

May import: shared/, worker/model/ and this package.
"""
