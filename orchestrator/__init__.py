"""The orchestrator: owns the committed tokens, runs guess -> verify -> rollback over gRPC on Ray.

It imports only the wire contract (`specd.v1`, `specd.proto.contract`) and talks to the services
over gRPC: no torch, no model files (the tokenizer comes from the target service).
"""
