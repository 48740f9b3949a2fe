"""Wire-level helpers both sides of a session call share (no torch, no gRPC).

The orchestrator computes these over its committed tokens; a service over the tokens it
holds. Equal answers mean both sides agree on the prefix (docs/architecture.md §3).
"""

import hashlib
import struct

# Trailing-metadata keys a service sets when it refuses a cursor: what it holds, so the
# caller can resend from there instead of from scratch.
HELD_TOKENS_KEY = "specd-held-tokens"
HELD_FINGERPRINT_KEY = "specd-held-fingerprint"
# Trailing-metadata key a service sets on every answered call: the seconds it spent on it
# (the caller's round trip minus this is network and gRPC time).
SERVICE_SECONDS_KEY = "specd-service-seconds"
# Trailing-metadata keys a service sets on every call a batched pass served: how many calls that
# pass carried, the positions it computed (every call as long as the longest: a verify of K beside
# decodes makes them all K + 1 long) and its compute seconds (no queueing). What the
# orchestrator's K chooser prices a step at the current load with (orchestrator/adaptive.py).
PASS_CALLS_KEY = "specd-pass-calls"
PASS_TOKENS_KEY = "specd-pass-tokens"
PASS_SECONDS_KEY = "specd-pass-seconds"
# ... and how many sessions it holds: the streams that could share a pass, whatever phase they
# are in (a speculative stream may be at the draft while the target runs a pass without it).
LIVE_SESSIONS_KEY = "specd-live-sessions"


def fingerprint(tokens) -> int:
    """64-bit fingerprint of a token-id sequence; 0 for the empty sequence."""
    if len(tokens) == 0:
        return 0
    digest = hashlib.blake2b(struct.pack(f"<{len(tokens)}I", *tokens), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def position_uniform(seed: int, position: int, stream: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position, stream).

    Sampling draws from these instead of a stateful generator, so the same call sent twice
    gives the same tokens (docs/architecture.md §3 rule 4) and every position's randomness is fresh.
    """
    digest = hashlib.blake2b(struct.pack("<QQQ", seed, position, stream), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


class Stream:
    """Independent random streams per position."""

    DRAFT = 1  # the draft's guess
    ACCEPT = 2  # the accept/reject coin
    TARGET = 3  # the target's own token: recovered, bonus or plain decode


# Prefix keys: a chain of hashes over fixed-size blocks of token ids, salted at the root by a cache
# salt, where each block's key stands for every token up to it. The services' prefix caches key their
# entries so (model/prefix_cache.py, 64-token blocks); the orchestrator's router keys the prompts it
# routed so (orchestrator/router.py, 16-token blocks).


def root_hash(salt: str) -> bytes:
    return hashlib.blake2b(salt.encode(), digest_size=16).digest()


def block_hashes(salt: str, tokens, blocks: int, block_tokens: int) -> list[bytes]:
    """The key after each of the first `blocks` blocks: blake2b(parent, block tokens), the salt at the root."""
    parent, out = root_hash(salt), []
    for index in range(blocks):
        block = tokens[index * block_tokens : (index + 1) * block_tokens]
        parent = hashlib.blake2b(parent + struct.pack(f"<{len(block)}I", *block), digest_size=16).digest()
        out.append(parent)
    return out


def tail_hash(salt: str, chain: list[bytes], tail) -> bytes:
    """The key of tokens that end inside a block: the key of their whole blocks (`chain`; the salt's
    root where there are none), then the tail, marked so that no block's key is ever a tail's."""
    parent = chain[-1] if chain else root_hash(salt)
    return hashlib.blake2b(parent + b"tail" + struct.pack(f"<{len(tail)}I", *tail), digest_size=16).digest()
