"""Generated text, token by token: an incremental detokenizer, stop strings
and the hold-back that keeps a stream from sending what a stop will cut.
No model is needed (testable with any ``decode(ids) -> str``).

``Detokenizer`` decodes a window of ids, never the whole output: the ids
since the last token boundary that was also a character boundary, and the
window's own prefix (decoded the same way, so a tokenizer that strips a
leading space or cleans up spaces treats both alike). A token that ends
inside a multi-byte character releases the window's complete characters
and holds the incomplete tail (its ``U+FFFD``) until a later token completes
it, or ``flush`` releases it as it decodes. Per token it costs the decode of
the window: O(the new text) in the usual case of a window of a few tokens.

``TextStream`` adds the stop strings of one request. The text released is
searched for each stop in its new part only; generation stops at the first
stop to end (the one that ends earliest in the text, the longest of those
that end there), and the text is cut where that stop starts. What is sent
(``push``'s first value) is the text less a tail that may still start a
stop, so the chunks sent always join to exactly ``text``, for every stop
and every way tokens split characters, and never contain a stop.
"""
from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["Detokenizer", "TextStream"]

REPLACEMENT = "\ufffd"


class Detokenizer:
    """``Detokenizer(decode)``: ``push(id)`` returns the text that id
    completes; ``flush()`` the held rest; ``text`` all text released."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0          # the window's first id (a character boundary)
        self._read = 0            # ids before this are released text
        self._prefix_len = 0      # characters that decode(ids[_prefix:_read]) gives
        self._released = 0        # characters of the window's text past _prefix_len released
        self.text = ""

    @property
    def ids(self) -> list[int]:
        return self._ids

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        return self._step(final=False)

    def flush(self) -> str:
        """The held text (an incomplete character as ``U+FFFD``), released."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._decode(self._ids[self._prefix:])
        new = window[self._prefix_len:]
        complete = new if final else new.rstrip(REPLACEMENT)
        delta = complete[self._released:]
        if len(new) == len(complete):      # the window ends on a character boundary
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_len = len(self._decode(self._ids[self._prefix:self._read]))
            self._released = 0
        else:
            self._released = max(self._released, len(complete))
        self.text += delta
        return delta


class TextStream:
    """One request's text: ``TextStream(decode, stops)``.

    ``push(id)`` -> (text to send now, whether a stop ended the text);
    ``finish()`` -> the text still to send when generation ends otherwise
    (end of sequence, ``max_tokens``), and whether a stop ended it. ``text``
    is the whole text (cut at the stop), ``sent`` the characters sent."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.detok = Detokenizer(decode)
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("the text ended at a stop string; nothing more comes")
        return self._take(self.detok.push(token), final=False)

    def finish(self) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        return self._take(self.detok.flush(), final=True)

    def _take(self, delta: str, final: bool) -> tuple[str, bool]:
        old = len(self.text)
        self.text += delta
        cut = self._first_stop(old)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._send(len(self.text)), True
        return self._send(len(self.text) if final else len(self.text) - self._hold()), False

    def _first_stop(self, old: int) -> int | None:
        """Where the stop that ends first in the text starts (the longest
        of those ending there), searching only what may end past ``old``."""
        best = None
        for s in self.stops:
            i = self.text.find(s, max(0, old - len(s) + 1))
            if i >= 0:
                key = (i + len(s), i)
                if best is None or key < best:
                    best = key
        return None if best is None else best[1]

    def _hold(self) -> int:
        """The longest tail of the text that is the start of a stop."""
        t = self.text
        for k in range(min(self._longest - 1, len(t)), 0, -1):
            tail = t[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _send(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out
