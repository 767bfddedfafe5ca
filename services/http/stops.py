"""Stop strings over a streamed answer: text is released only once it cannot be the start of a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str], keep: bool = False):
        self.stops = [s for s in stops if s]
        self.keep = keep                   # include the matched stop string in the output (SGLang's no_stop_trim)
        self.matched: str | None = None
        self._held = ""

    def feed(self, text: str) -> str:
        """The text that can be shown now; after a match (see `matched`) nothing more is."""
        if self.matched is not None:
            return ""
        buffer = self._held + text
        found = [(i, s) for s in self.stops if (i := buffer.find(s)) >= 0]
        if found:
            i, stop = min(found)
            self.matched, self._held = stop, ""
            return buffer[:i] + (stop if self.keep else "")
        hold = max((n for s in self.stops for n in range(1, len(s)) if buffer.endswith(s[:n])), default=0)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """The answer ended without a match: what was held back is shown."""
        held, self._held = self._held, ""
        return held
