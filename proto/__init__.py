"""The wire contract every specd party shares (no torch).

`specd.v1` holds the messages and stubs generated from `specd/v1/*.proto` (proto/generate.sh);
this package holds what both ends of a call need beyond the messages: the session-cursor
contract (contract.py), the services' limits (limits.py), bearer tokens and TLS (auth.py,
interceptors.py), the metrics exporter (metrics.py), top log-probabilities in and out of their
messages (logprobs.py), a SpecDecode client (client.py) and the
gRPC reference page generated from the protos' comments (reference.py, docs/reference/grpc.md).
"""
