"""Output parsers: how a reply's generated text becomes answer text and tool calls, for every
protocol (base.py: the seam; reply.py: the chain; registry.py: formats by name). Each format is
one module that registers itself; importing this package registers the built-in ones."""
from api.core.parsers import generic, hermes  # noqa: F401 - registers the built-in formats
from api.core.parsers import llama3_json  # noqa: F401 - registers llama3_json
from api.core.parsers import deepseek_v3  # noqa: F401 - registers deepseek_v3
from api.core.parsers import mistral  # noqa: F401 - registers mistral
from api.core.parsers import qwen3_coder  # noqa: F401 - registers qwen3_coder
from api.core.parsers import harmony  # noqa: F401 - registers harmony
