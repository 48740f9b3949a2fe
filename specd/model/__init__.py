"""The shared model package: loading, per-session KV caches, sampling maths. No gRPC here."""
