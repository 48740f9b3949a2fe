"""Prompt lookup: guesses that cost no model, from where the text already said what comes next.

When the output repeats the prompt or itself (editing code, renaming, adding types or docstrings,
answering about a given file), the tokens after the latest earlier occurrence of the context's
last n tokens are a good guess for the next ones (prompt lookup decoding, Saxena 2023; vLLM's
`ngram` and transformers' `prompt_lookup_num_tokens`). The longest n in MIN_NGRAM..MAX_NGRAM with
an earlier occurrence wins; among its occurrences, the latest.

The index lives with the request's committed tokens in the orchestrator, which alone owns them
(docs/architecture.md §3): a lookup guess costs no call, no round trip and no draft pass. Guesses
are deterministic, so when sampling their q is one-hot: the acceptance rule stays exact (a guess x
is kept with probability p(x), and a rejection draws from p without x).
"""

# Who guesses: each step the better of the suffix drafter (suffix.py) and the draft model, the draft
# model alone, this prompt lookup alone, the suffix drafter alone.
DRAFTERS = ("hybrid", "model", "ngram", "suffix")
DEFAULT_DRAFTER = "hybrid"
LOOKUP_ONLY = ("ngram", "suffix")  # the drafters that never ask the draft model
MIN_NGRAM = 2  # one token matches everywhere in code (`(`, `\n`): a guess needs a pair to go on
MAX_NGRAM = 4


class PromptLookup:
    """A request's n-gram index over its committed tokens, kept up to date as they grow."""

    def __init__(self, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # n-gram -> the index just past its latest occurrence that has a token after it
        self.ends: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Index newly committed tokens. An n-gram is indexed once a token follows it, so the
        context's own last n-gram is never its own match."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here now have `token` after them
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self.ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram ending the context, where it last occurred."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            end = self.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []
