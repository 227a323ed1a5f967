"""Incremental detokenization with stop strings, for streaming responses.

In: committed token ids, a round at a time (`push`). Out: the text that became final, as a
delta. Two subtleties:
  - a token may be half of a multi-byte character, or change how the previous tokens decode
    (BPE merges across spaces): text is decoded over a short window of the last tokens and
    emitted only once it no longer ends in U+FFFD;
  - a stop string may arrive split across rounds: the last len(longest stop) - 1 characters are
    held back until the request finishes, and the text is cut before the first stop string.
The concatenated deltas equal `final_text()`, which equals the non-streaming text.

    ts = TextStream(tokenizer, stop=["\\n\\n"])
    delta = ts.push(new_ids)           # per round
    tail = ts.finish()                 # when the request finished
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Token ids in, text deltas out (vLLM/TGI's prefix/read offsets)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0    # tokens before this are already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is left once no more tokens come (a dangling partial character included)."""
        full = self._decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self._prefix = self._read = len(self.ids)
        return delta


class TextStream:
    """Detokenizer plus OpenAI stop-string semantics: the text ends before the first stop string."""

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0
        self.matched_stop: str | None = None

    def _visible(self, text: str) -> str:
        cut = len(text)
        for s in self.stop:
            i = text.find(s)
            if 0 <= i < cut:
                cut, self.matched_stop = i, s
        return text[:cut]

    def push(self, new_ids: list[int]) -> str:
        self.detok.push(new_ids)
        text = self.detok.text
        vis = self._visible(text)
        end = len(vis) if self.matched_stop is not None else max(self.sent, len(text) - self._hold)
        delta = vis[self.sent:end]
        self.sent += len(delta)
        return delta

    def finish(self) -> str:
        self.detok.flush()
        vis = self._visible(self.detok.text)
        delta = vis[self.sent:]
        self.sent += len(delta)
        return delta

    def final_text(self) -> str:
        return self._visible(self.detok.text)
