# syntax=docker/dockerfile:1
# Raincheck Serve: one image for the frontend, the decode workers and the Ray deferred workers
# (`raincheck <command>`; the KubeRay pods run `ray start` from it). Build from the repository root:
#   docker build -t raincheck-serve:0.1.0 .                                          # CPU torch
#   docker build --build-arg TORCH_VARIANT=cuda -t raincheck-serve:0.1.0-cuda .      # CUDA torch
# It installs exactly as `make test` and `make demo` do: `bash scripts/setup.sh <venv>` (torch==2.13.0
# first, then requirements/runtime.txt + dev.txt, then the project in editable mode).

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---------------------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build
# cpu: torch==2.13.0 resolves to the +cpu wheel of the PyTorch CPU index (no CUDA libraries);
# cuda: to PyPI's default Linux wheel, which brings its CUDA libraries (the host needs only the driver).
ARG TORCH_VARIANT=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
COPY . /app
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "$TORCH_VARIANT" = cpu ]; then export PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX"; fi \
    && bash scripts/setup.sh /opt/venv \
    && /opt/venv/bin/python -m compileall -q /app

# -------------------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="raincheck-serve" \
      org.opencontainers.image.description="Raincheck Serve: multi-turn multimodal chat with deferred prefill" \
      org.opencontainers.image.licenses="Apache-2.0"
# gcc: the native CPU kernels are compiled on first use for the CPU the pod lands on (docs/design.md,
# "Engine shape"); without it the engine runs its torch path. Not pinned: the base image's Debian release
# fixes the compiler's major version, and a pinned point release disappears from the archive.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 raincheck \
    && useradd --system --uid 10001 --gid raincheck --create-home --home-dir /home/raincheck raincheck \
    && echo "export PATH=/opt/venv/bin:\$PATH" > /etc/profile.d/raincheck-venv.sh
# The same paths as in the build stage: the editable install points at /app.
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
# RAINCHECK_MODEL: the demo model (v2, models/demo-v2; what the name "demo" stands for), so that a bare
# `docker run` answers real questions; clients know it as "demo". v1 is in the image too (`--model demo-v1`).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RAINCHECK_MODEL=/app/models/demo-v2 \
    RAINCHECK_MODEL_NAME=demo \
    RAINCHECK_TORCH_VARIANT=${TORCH_VARIANT} \
    RAY_USAGE_STATS_ENABLED=0
WORKDIR /app
USER 10001:10001
EXPOSE 50051 50061
# gRPC health (grpc.health.v1) of the server on RAINCHECK_HEALTH_PORT (default 50051, the frontend;
# 50061 for a decode worker). Kubernetes ignores this and uses the manifests' grpc probes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; channel = grpc.insecure_channel('127.0.0.1:' + os.environ.get('RAINCHECK_HEALTH_PORT', '50051')); reply = g.HealthStub(channel).Check(h.HealthCheckRequest(), timeout=4); sys.exit(0 if reply.status == h.HealthCheckResponse.SERVING else 1)"]
# The embedded default for a smoke run: frontend + one decode worker in one process. Without API keys
# it refuses a non-loopback address: docker run -e RAINCHECK_API_KEYS=... -p 50051:50051 IMAGE
CMD ["raincheck", "serve", "--host", "0.0.0.0", "--port", "50051"]
