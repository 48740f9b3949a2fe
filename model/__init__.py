"""The shared model package: loading, per-session KV caches, sampling maths. No gRPC here."""

import logging

# transformers imports torchao when it is installed; torchao then logs about CUDA kernels a CPU
# build cannot load, and torch about torchao's enums. Noise in every process, not the user's concern.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
