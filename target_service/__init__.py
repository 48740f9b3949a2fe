"""The target service: a gRPC server around the target model (verifies drafts in one pass)."""
