"""specd: distributed speculative decoding.

Folders are the architecture: `v1/` (generated from `proto/`), `model/` (shared model code,
no gRPC), `draft_service/`, `target_service/`, `orchestrator/`, `deploy/`, `cli/`.
"""

__version__ = "0.1.0"
