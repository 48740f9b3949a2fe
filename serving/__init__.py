"""The gRPC host both model services share: one model thread behind a batching scheduler,
engine errors as status codes, health, reflection, idle eviction, metrics, graceful shutdown.
The servicers in draft_service/ and target_service/ stay thin on top of it."""
