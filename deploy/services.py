"""A model service of either role, ready to start: what `specd serve draft|target` and the
cluster's service actors both run. The model packages are imported only here, when a service is
built, so deploy/ itself stays torch-free (docs/architecture.md §1)."""

from specd.proto.limits import Limits


def model_server(
    role: str,
    model: str,
    dtype: str | None,
    threads: int | None,
    quantize: str,
    limits: Limits,
    device: str = "auto",
    cuda_graphs: str = "auto",
    engine: str = "auto",
    exactness: str = "bitwise",
):
    """A ModelServer for `role` ("draft" or "target"): start() binds it; load() loads the engine.

    `device`: auto, cpu, cuda or cuda:N, resolved for the role where the service runs
    (model/devices.py: auto puts a target on cuda:0 when a GPU is visible, a draft on the CPU);
    `cuda_graphs`: auto (on for a CUDA device), on or off; `engine`: auto, transformers or llama.cpp
    (model/loading.py choose_engine: auto is llama.cpp for a GGUF on a CPU); `exactness`: the
    llama.cpp engine's --exactness (proto/limits.py EXACTNESS)."""
    from specd.model.loading import load_engine

    if role == "draft":
        from specd.draft_service.drafter import Drafter as service
        from specd.draft_service.server import create_draft_server as create_server
    else:
        from specd.target_service.server import create_target_server as create_server
        from specd.target_service.verifier import Verifier as service

    def load():
        loaded = load_engine(
            role,
            model,
            dtype,
            threads,
            quantize,
            device=device,
            cuda_graphs=cuda_graphs,
            engine=engine,
            limits=limits,
            exactness=exactness,
        )
        return service(loaded, limits)

    return create_server(load)
