"""Stop strings, matched across token boundaries and never leaked into the streamed text."""

from __future__ import annotations


class StopChecker:
    """Feed text deltas in; get back the text that is safe to emit.

    Up to len(longest stop) - 1 trailing characters are held back, since they may be the start of a stop
    string that the next token completes. Once a stop string appears, the text before it is released and
    everything from the stop string on is dropped.
    """

    def __init__(self, stop: list[str] | None, include_stop: bool = False):
        """include_stop: the stop string itself is released too (vLLM's include_stop_str_in_output)."""
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stop:
            return delta
        self.pending += delta
        hits = [(i, -len(s)) for i, s in ((self.pending.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            at, minus_length = min(hits)  # the earliest stop string, the longest of those starting there
            self.matched = self.pending[at : at - minus_length]
            out, self.pending = self.pending[: at - minus_length * self.include_stop], ""
            return out
        cut = max(0, len(self.pending) - self.holdback)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back text, when the request ends for another reason."""
        out, self.pending = self.pending, ""
        return out
