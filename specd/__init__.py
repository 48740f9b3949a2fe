"""specd: distributed speculative decoding.

Folders are the architecture: `v1/` (generated from `proto/`), `model/` (shared model code,
no gRPC), `draft_service/`, `target_service/`, `orchestrator/`, `deploy/`, `cli/`.
"""

import logging

__version__ = "0.1.0"

# transformers imports torchao when it is installed; torchao then logs about CUDA kernels a CPU
# build cannot load, and torch about torchao's enums. Noise in every process, not the user's concern.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
