"""How one model service of a role runs: the same settings for the draft and the target (issue 51:
one per-role type, where `draft_X=..., target_X=...` keyword blocks were fanned through every caller).
StackConfig and ClusterConfig hold one per role, `specd serve draft|target` builds one from its flags,
the stack commands one per role (cli/common.py `roles_from_args`), and deploy/services.py's
`model_server` and the cluster's service actors take one. Torch-free: deploy/ imports it freely."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RoleConfig:
    model: str  # a default-pair name ("draft", "target", ...), a local HF folder, or a hub id
    quantize: str | None = None  # auto, none, int8 or int4; None: the service's default (auto)
    device: str | None = None  # auto, cpu, cuda or cuda:N, resolved where the service runs; None: auto
    cuda_graphs: str | None = None  # auto, on or off; None: auto (on for a CUDA device)
    engine: str | None = None  # auto, transformers, llama.cpp or sim[:...]; None: auto
    threads: int | None = None  # the service's threads; None: the stack's (else all cores)
    port: int | None = 0  # replica 0's gRPC port (replica i: + REPLICA_PORT_STEP i); 0: a free one
    metrics_port: int | None = 0  # its Prometheus /metrics, alike; None: off (a cluster's)
    replicas: int = 1  # services of this role, each on ports of its own

    def service_options(self) -> dict:
        """deploy/services.py `model_server`'s engine keywords, `auto` where unset."""
        return {
            "quantize": self.quantize or "auto",
            "device": self.device or "auto",
            "cuda_graphs": self.cuda_graphs or "auto",
            "engine": self.engine or "auto",
        }
