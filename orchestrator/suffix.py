"""Suffix drafting: guesses ranked by how often a continuation followed the context, here and lately.

Prompt lookup (lookup.py) takes the latest earlier occurrence of the context's last 2-4 tokens and
copies what followed, as far as K. Suffix decoding (Arctic Inference, Oliaro et al. 2024; vLLM's
`suffix` method) counts instead: for the longest suffix of the context seen before (of the
SUFFIX_LENGTHS, up to 16 tokens), each token that followed it, how often. The guess takes the most
frequent one (on a tie the latest), joins it to the context and goes on, while the product of the
chosen tokens' shares (the guess's confidence) stays at or above MIN_CONFIDENCE, up to K: the guess
is as long as the counts are sure of it. A continuation seen once is sure; a context followed by
three different tokens is not.

Two sources of counts, summed for the longest suffix either has seen:
- the request's own tokens (prompt + output), indexed as they are committed, as lookup.py does;
- its worker's recent outputs (`RecentOutputs`, one per orchestrator worker as ServiceCosts is),
  bounded by a token budget, the oldest output evicted first, counts and all; indexed per cache salt,
  so a tenant learns only from its own outputs. Only outputs, what a
  target committed: they say how the model writes (the boilerplate and idioms it repeats across
  requests); another request's prompt says how that user wrote, and a few long prompts would fill
  the budget.

A step costs one dictionary look-up per context length for each guessed token (and a scan of the
matched context's continuations), never a walk over the index; committing a token costs one update
per context length. Contexts are keyed by their hash: a collision (about 1 in 2^64 a pair) could
only make a wrong guess, which the target rejects. Guesses are deterministic: q is one-hot when
sampling (generation.py), as for any lookup guess.

Measured offline (a replay: each step the drafter guesses up to 8 tokens, the known continuation
keeps the agreeing prefix and one token more; Qwen2.5 tokenizer): on 40 real edits from this
repository's history (old file as the prompt, the new file's edited region as the answer, 54k
tokens) the request's own counts alone make 4.51 tokens a step at α 0.76 against the prompt
lookup's 4.21 at 0.62, and with the recent outputs 4.93 at 0.73; on bench/prompts_edit.jsonl with a
constructed answer (the code with its renames applied), 4.51 at 0.74 against 4.39 at 0.69. So
`hybrid` takes its lookup guesses from here.
"""

from collections import deque

from specd.orchestrator.lookup import MIN_NGRAM

# The context lengths counted: each up to 4, then sparser (a match of 10 counts as one of 8): half the
# entries per token of every length up to 16, and measured as good (4.93 tokens a step against 4.93;
# up to 8 only, 4.75).
SUFFIX_LENGTHS = (MIN_NGRAM, 3, 4, 6, 8, 12, 16)
MIN_CONFIDENCE = 0.3  # the product of the guessed tokens' shares below which the guess stops
RECENT_BUDGET_TOKENS = 100_000  # a worker's recent outputs kept in its index: about 60 MB of counts

Counts = dict[int, int]  # next token -> how often it followed; dict order = most recently counted last


class SuffixCounts:
    """How often each token followed each context (of the lengths counted) in the sequences added,
    less those removed. A context followed once is stored as that token alone, not as {token: 1}:
    most long contexts occur once, and a dict would take four times the memory."""

    def __init__(self, lengths: tuple[int, ...] = SUFFIX_LENGTHS):
        self.lengths = lengths
        self.next: dict[int, Counts | int] = {}  # hash(context) -> what followed it

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Count the tokens from `start` on after their contexts (the tokens before them, from 0)."""
        for end in range(max(start, MIN_NGRAM), len(tokens)):
            token = tokens[end]
            for n in self.lengths:
                if n > end:
                    break
                context = hash(tuple(tokens[end - n : end]))
                seen = self.next.get(context)
                if seen is None:
                    self.next[context] = token
                    continue
                counts = {seen: 1} if isinstance(seen, int) else seen
                counts[token] = counts.pop(token, 0) + 1  # re-inserted: the latest counted is last
                self.next[context] = counts

    def remove(self, tokens: list[int]) -> None:
        """Undo `add(tokens)`: what is no longer counted is gone from the index."""
        for end in range(MIN_NGRAM, len(tokens)):
            token = tokens[end]
            for n in self.lengths:
                if n > end:
                    break
                context = hash(tuple(tokens[end - n : end]))
                counts = self.next[context]
                if isinstance(counts, int):
                    del self.next[context]
                    continue
                counts[token] -= 1
                if not counts[token]:
                    del counts[token]
                if len(counts) == 1 and next(iter(counts.values())) == 1:
                    self.next[context] = next(iter(counts))  # followed once again: the token alone

    def get(self, context: tuple[int, ...]) -> Counts | None:
        """What followed `context`, and how often; None if it never occurred with a token after it."""
        seen = self.next.get(hash(context))
        return {seen: 1} if isinstance(seen, int) else seen


class RecentOutputs:
    """A worker's suffix counts over its latest requests' outputs, one index per cache salt, at most
    `budget` tokens of them in all: adding one past the budget evicts the oldest outputs, whoever's,
    counts and all. A request's drafter reads only its own salt's index: a tenant's guesses, and so
    its speed, never depend on another tenant's outputs (the unsalted requests share one)."""

    def __init__(self, budget: int = RECENT_BUDGET_TOKENS, lengths: tuple[int, ...] = SUFFIX_LENGTHS):
        self.budget = budget
        self.lengths = lengths
        self.by_salt: dict[str, SuffixCounts] = {}  # cache_salt -> the counts of its outputs kept
        self.outputs: deque[tuple[str, list[int]]] = deque()  # (salt, output), oldest first
        self.tokens = 0  # in self.outputs

    def add(self, output: list[int], salt: str = "") -> None:
        """A finished request's output (the target's tokens); one longer than the budget keeps its tail."""
        output = list(output[max(0, len(output) - self.budget) :]) if self.budget else []
        if len(output) <= MIN_NGRAM:
            return  # no context with a token after it
        self.by_salt.setdefault(salt, SuffixCounts(self.lengths)).add(output)
        self.outputs.append((salt, output))
        self.tokens += len(output)
        while self.tokens > self.budget:
            owner, oldest = self.outputs.popleft()
            self.by_salt[owner].remove(oldest)
            if not self.by_salt[owner].next:
                del self.by_salt[owner]
            self.tokens -= len(oldest)

    def get(self, context: tuple[int, ...], salt: str = "") -> Counts | None:
        """What followed `context` in the outputs of requests with this salt, and how often."""
        counts = self.by_salt.get(salt)
        return counts.get(context) if counts else None


class SuffixDrafter:
    """A request's suffix drafter: counts over its committed tokens, kept up to date as they grow,
    beside its worker's recent outputs. The same interface as lookup.py's PromptLookup."""

    def __init__(
        self,
        recent: RecentOutputs | None = None,
        lengths: tuple[int, ...] = SUFFIX_LENGTHS,
        min_confidence: float = MIN_CONFIDENCE,
        salt: str = "",
    ):
        self.recent = recent
        self.salt = salt  # the request's cache_salt: only its tenant's recent outputs are read
        self.min_confidence = min_confidence
        self.tokens: list[int] = []
        self.own = SuffixCounts(lengths)
        self.longest = max(lengths)

    def extend(self, tokens: list[int]) -> None:
        """Index newly committed tokens. A context is counted once a token follows it, so the
        context's own tail is never its own match."""
        start = len(self.tokens)
        self.tokens += tokens
        self.own.add(self.tokens, start)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens, each the most frequent after the longest suffix seen of the context so far
        (guesses included), while the product of their shares stays at or above min_confidence."""
        context = self.tokens[max(0, len(self.tokens) - self.longest) :]
        guesses, confidence = [], 1.0
        while len(guesses) < k:
            counts = self.continuations(context)
            if not counts:
                break
            token, count = max(reversed(counts.items()), key=lambda item: item[1])  # ties: the latest
            confidence *= count / sum(counts.values())
            if confidence < self.min_confidence:
                break
            guesses.append(token)
            context = context[len(context) == self.longest :] + [token]
        return guesses

    def continuations(self, context: list[int]) -> Counts:
        """What followed the longest suffix of `context` that either source has seen, and how often
        (both sources summed; this request's own counted last, so on a tie its latest wins)."""
        for n in reversed(self.own.lengths):
            if n > len(context):
                continue
            suffix = tuple(context[len(context) - n :])
            own, earlier = self.own.get(suffix), self.recent.get(suffix, self.salt) if self.recent else None
            if own and earlier:
                merged = dict(earlier)
                for token, count in own.items():
                    merged[token] = merged.pop(token, 0) + count
                return merged
            if own or earlier:
                return own or earlier
        return {}
