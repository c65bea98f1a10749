"""Output parsers: how a reply's generated text becomes answer text and tool calls, for every
protocol (base.py: the seam; reply.py: the chain; registry.py: formats by name). Each format is
one module that registers itself; importing this package registers the built-in ones."""
from api.core.parsers import generic, hermes  # noqa: F401 - registers the built-in formats
