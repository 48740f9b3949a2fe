"""A model service of either role, ready to start: what `specd serve draft|target` and the
cluster's service actors both run. The model packages are imported only here, when a service is
built, so deploy/ itself stays torch-free (docs/architecture.md §1)."""

from contextlib import nullcontext

from specd.deploy.roles import RoleConfig
from specd.proto.limits import Limits, is_sim_engine


def model_server(role: str, settings: RoleConfig, dtype: str | None, limits: Limits, exactness: str = "bitwise"):
    """A ModelServer for `role` ("draft" or "target"): start() binds it; load() loads the engine.

    `settings`: its model, and `device` (auto, cpu, cuda or cuda:N, resolved for the role where the
    service runs, model/devices.py: auto puts a target on cuda:0 when a GPU is visible, a draft on the
    CPU), `cuda_graphs` (auto: on for a CUDA device), `engine` (auto, transformers or llama.cpp;
    model/loading.py choose_engine: auto is llama.cpp for a GGUF on a CPU), `quantize`, `threads`;
    `exactness`: the llama.cpp engine's --exactness (proto/limits.py EXACTNESS)."""
    from specd.model.loading import load_engine

    if role == "draft":
        from specd.draft_service.drafter import Drafter as service
        from specd.draft_service.server import create_draft_server as create_server
    else:
        from specd.target_service.server import create_target_server as create_server
        from specd.target_service.verifier import Verifier as service

    def load():
        import torch

        from specd.model.devices import resolve_device
        from specd.model.pass_profile import alone, pass_profile

        options = settings.service_options()
        on_cpu = resolve_device(role, options["device"]).type == "cpu" and not is_sim_engine(options["engine"])
        # a CPU service loads and measures with the cores to itself (model/pass_profile.py alone)
        with alone() if on_cpu else nullcontext():
            loaded = load_engine(
                role, settings.model, dtype, settings.threads, limits=limits, exactness=exactness, **options
            )
            # what its passes cost here, for the orchestrator's first steps (measured once per machine and model)
            measured = pass_profile(loaded, {"exactness": exactness, "threads": torch.get_num_threads()})
        served = service(loaded, limits)
        served.passes = measured
        return served

    return create_server(load)
