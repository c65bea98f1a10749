"""Incremental detokenization and stop strings for one request (pure Python).

Text is released only when it is final: never half of a multi-byte character (a token can
end in the middle of one), and never the start of what may turn out to be a stop string.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
# One generated id in; the text it completes, or None while a character is still partial.
# A fresh one per request: `tokenizers.decoders.DecodeStream.step` bound to the tokenizer.
Step = Callable[[int], str | None]
REPLACEMENT = "\ufffd"  # what decoding gives for an incomplete UTF-8 sequence


class Detokenizer:
    """Turns a request's generated ids into text deltas.

    With `stream` (a factory of `Step`s, from `Tokenizer.decode_stream`), each id costs one
    call into the tokenizers library's DecodeStream. Without one, the same window algorithm
    runs here on `decode` (two decodes per id). DecodeStream keeps the ids since the last text
    it released and the text they decode to; `_prefix`/`_read` mirror that window so that
    `flush` can decode what DecodeStream is still holding.
    """

    def __init__(self, decode: Decode, stop: Sequence[str] = (), stream: Callable[[], Step] | None = None):
        self._decode = decode
        self._stop = tuple(stop)
        self._stream = stream
        self._step = stream() if stream else None
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already counted; context for the next
        self._read = 0
        self.text = ""  # decoded text so far (cut at the stop string once one matched)
        self._released = 0  # characters of `text` handed out as deltas
        self.stopped = False  # a stop string matched

    @property
    def mid_character(self) -> bool:
        """Whether the last tokens end inside a character (bytes of it still to come)."""
        return self._read < len(self._ids)

    def push(self, token_id: int) -> str:
        """Add a generated token; return the text that is now final (may be empty)."""
        self._ids.append(token_id)
        if self._step is not None:
            try:
                piece = self._step(token_id)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception (see below)
                # DecodeStream refuses when a decoder rewrites the window's earlier text (the
                # longer decode does not start with the shorter one). The loop below slices
                # anyway, as this code always did, so this request continues on it.
                self._step = None
            else:
                if piece is not None:  # DecodeStream moved its window: so does the mirror
                    self.text += piece
                    self._prefix, self._read = self._read, len(self._ids)
                return self._release(final=False)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def resume(self, token_ids: list[int], released_chars: int) -> None:
        """Rebuild the state after `token_ids` of which `released_chars` characters were already
        sent (by a worker that died): the held-back rest comes out as usual, nothing twice."""
        # Replayed one by one, not primed with DecodeStream(ids=...): priming would start the
        # window at the first resumed id, so the next deltas could differ from what the first
        # worker would have sent; replaying leaves exactly its window (and builds `text`).
        for token_id in token_ids:
            self.push(token_id)
        self._released = max(self._released, min(released_chars, len(self.text)))

    def flush(self) -> str:
        """At the end: decode what is still pending (even an incomplete character) and release all."""
        if not self.stopped and self._read < len(self._ids):
            # DecodeStream has no way to force out a partial character: decode the window once.
            before = self._decode(self._ids[self._prefix:self._read])
            self.text += self._decode(self._ids[self._prefix:])[len(before):]
            self._prefix = self._read = len(self._ids)
            if self._step is not None:
                self._step = self._stream()  # an empty window, as _prefix == _read now says
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self._stop:
            hit = self._find_stop()
            if hit is not None:
                self.stopped = True
                self.text = self.text[:hit]
                end = hit
            elif not final:
                end -= self._held_back()
        delta = self.text[self._released:end]
        self._released = end
        return delta

    def _find_stop(self) -> int | None:
        # A match cannot start before _released: that text was checked and held no stop prefix.
        hits = [i for s in self._stop if (i := self.text.find(s, self._released)) != -1]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of unreleased text that could begin a stop string."""
        tail = len(self.text) - self._released
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, tail), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
