"""The gRPC host both model services share, whatever the engine: the model thread behind a
batching scheduler (thread.py), messages and status codes (messages.py), health, reflection,
idle eviction and graceful shutdown (server.py), metrics (metrics.py). The servicers in
draft_service/ and target_service/ stay thin on top of it."""
