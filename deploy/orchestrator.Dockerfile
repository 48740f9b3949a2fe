# specd's orchestrator image, also the Ray head's: the wire contract, the orchestrator, deploy, the load
# tester and the command line, and no torch, transformers or model files (docs/architecture.md §1). The
# build fails if anything pulled torch in.
#
#   docker build -f deploy/orchestrator.Dockerfile -t specd-orchestrator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1

WORKDIR /opt/specd
COPY proto ./proto
COPY orchestrator ./orchestrator
COPY deploy ./deploy
COPY bench ./bench
COPY cli ./cli
RUN pip install --no-cache-dir ./proto ./orchestrator ./deploy ./bench ./cli "ray[default]==2.60.0" \
    && python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'transformers')))"

# SpecDecode gRPC, OpenAI-compatible HTTP, orchestrator metrics, Ray GCS, dashboard
EXPOSE 50051 8000 9451 6379 8265

# Standalone: an orchestrator for a draft and a target reachable as `draft` and `target` (e.g. Compose
# services). On KubeRay the operator replaces this with `ray start`; see deploy/kuberay/.
CMD ["specd", "serve", "orchestrator", "--host", "0.0.0.0", "--draft", "draft:50061", "--target", "target:50062"]
