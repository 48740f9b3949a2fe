"""The shared model package, no gRPC: the engine interface (engine.py) and its transformers
implementation, session bookkeeping (sessions.py), what both services share (service.py), the
model thread's scheduler, loading and the model store, sampling and acceptance maths."""

import logging

# transformers imports torchao when it is installed; torchao then logs about CUDA kernels a CPU
# build cannot load, and torch about torchao's enums. Noise in every process, not the user's concern.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
