"""Stop sequences matched on the generated text, across token boundaries.

EOS and max_new_tokens are token-level and live on the Sequence; stop strings need
text, so they are checked here on the detokenized stream. As in TGI, the text keeps
the stop sequence (and whatever the token that completed it carried).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopSequenceMatcher:
    stop_sequences: tuple[str, ...]
    _tail: str = field(default="", repr=False)
    _keep: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self._keep = max((len(s) for s in self.stop_sequences), default=0)

    def feed(self, text: str) -> str | None:
        """Add newly generated text; returns the stop sequence it completed, if any."""
        if not self.stop_sequences or not text:
            return None
        window = self._tail + text
        for stop in self.stop_sequences:
            # only matches that end inside the new text are new
            if stop in window[max(0, len(self._tail) - len(stop) + 1) :]:
                return stop
        self._tail = window[-(self._keep - 1) :] if self._keep > 1 else ""
        return None
