"""Tokens -> text for a stream: incremental detokenization and stop strings.

Decoding token by token breaks multi-byte characters and drops the leading spaces some
tokenizers encode in the next token. So, like vLLM and TGI, decode a short window of
already-printed tokens plus the new ones and print only what grew, holding back text while
it ends in an incomplete character (U+FFFD) or could still become a stop string.
"""

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # printed tokens re-decoded for context


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # decoded output so far (stop string included, if hit)
        self.printed = 0  # characters of self.text already handed out
        self.read_offset = 0  # tokens whose text is settled
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        """Take newly committed tokens; return the text they complete (maybe '')."""
        if self.stopped:
            return ""  # nothing after a stop string is ever printed
        self.tokens += tokens
        prefix_offset = max(0, self.read_offset - CONTEXT_TOKENS)
        window = self._decode(self.tokens[prefix_offset:])
        if window.endswith(REPLACEMENT):
            return ""  # a character is still incomplete: wait for its next bytes
        settled = self._decode(self.tokens[prefix_offset : self.read_offset])
        self.text += window[len(settled) :]
        self.read_offset = len(self.tokens)
        return self._release()

    def finish(self) -> str:
        """The text still held back, at the end of the stream: also that of tokens ending in an incomplete
        character (decoded as the tokenizer decodes them, with U+FFFD), so the stream's text is the
        same however its tokens were grouped into steps."""
        if self.stopped:
            return ""
        if self.read_offset < len(self.tokens):
            prefix_offset = max(0, self.read_offset - CONTEXT_TOKENS)
            settled = self._decode(self.tokens[prefix_offset : self.read_offset])
            self.text += self._decode(self.tokens[prefix_offset:])[len(settled) :]
            self.read_offset = len(self.tokens)
        released = self._release()  # a stop string may end in the tail
        if self.stopped:
            return released
        self.stop = []
        return released + self._release()

    def _release(self) -> str:
        end = len(self.text)
        for stop in self.stop:
            found = self.text.find(stop, max(0, self.printed - len(stop) + 1))
            if found != -1 and found < end:
                end, self.stopped = found, True
        if not self.stopped and self.stop:  # hold back what could be the start of a stop string
            end = min(end, len(self.text) - self._stop_prefix_length())
        if end < self.printed:
            return ""
        released, self.printed = self.text[self.printed : end], end
        return released

    def _stop_prefix_length(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
