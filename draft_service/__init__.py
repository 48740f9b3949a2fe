"""The draft service: a gRPC server around the draft model (guesses K tokens per call)."""
