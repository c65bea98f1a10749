"""The Redis side of a worker: its share of the queue's lanes (intake), publishing tokens and
ends, heartbeats, cancels, metrics and tracing, around one engine on its model thread.

May import: shared/, worker/model/, worker/engine/ and this package; not a backend (main.py
picks one and hands it in).
"""
