# specd's model-service image: every component (the draft and target services with torch, and the
# orchestrator, deploy and cli parts, so a Ray worker node can host any actor `specd up` places on it),
# plus Ray's dashboard extras and the default model pair, fetched, sha256-checked and converted at build
# time (pods reach no model hub). The same install as scripts/setup.sh, not editable.
#
#   docker build -f deploy/service.Dockerfile -t specd:0.1.0 .                  # CPU torch (draft nodes)
#   docker build -f deploy/service.Dockerfile --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#       -t specd:0.1.0-cuda .                                                    # CUDA torch (target nodes)
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG FETCH_MODELS=1
ENV SPECD_CACHE=/opt/specd/cache \
    PYTHONUNBUFFERED=1

WORKDIR /opt/specd
COPY proto ./proto
COPY model ./model
COPY serving ./serving
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY orchestrator ./orchestrator
COPY deploy ./deploy
COPY bench ./bench
COPY cli ./cli
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" \
        ./proto ./model ./serving ./draft_service ./target_service ./orchestrator ./deploy ./bench ./cli \
        "ray[default]==2.60.0" \
    && if [ "$FETCH_MODELS" = 1 ]; then specd models fetch --engine transformers; fi

# SpecDecode gRPC, OpenAI-compatible HTTP, orchestrator metrics, draft and target gRPC, Ray GCS, dashboard
EXPOSE 50051 8000 9451 50061 50062 6379 8265

# Standalone demo: the whole stack in this container, one completion with its stats.
# On KubeRay the operator replaces this with `ray start`; see deploy/kuberay/.
CMD ["specd", "generate", "def quicksort(arr):"]
