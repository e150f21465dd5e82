# syntax=docker/dockerfile:1
# The loraplex adapter store sidecar (loraplex-store) on slim Python. The chart also runs
# its fetch-model init container (S3 -> the pod) with this image's Python and boto3.
#
#   docker build -f docker/store.Dockerfile -t loraplex/store:0.1.0 .
#
# The store imports none of the server's stack (torch, transformers, xgrammar, triton: GBs), so
# its image installs the project's wheel without dependencies, then only the packages the store
# and the fetch-model script import, each pinned as pyproject.toml pins it.
# tests/helm/test_dockerfiles.py checks the pins against pyproject.toml and builds the wheel the
# same way; tests/store/test_store_image_packages.py runs a store that can import nothing else.

ARG PYTHON_IMAGE=python:3.11-slim

# --- 1. the project's wheel (its build hook generates the gRPC code from protos/) --------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# --- 2. a virtual environment: the wheel, then the store's own dependencies -----------------
FROM ${PYTHON_IMAGE} AS venv
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /dist /dist
# DL3013 cannot see the pins: the project is the local wheel; the rest are pyproject.toml's specifiers.
# hadolint ignore=DL3013
RUN set -- /dist/loraplex-*.whl && python -m pip install --no-deps "$1"
# hadolint ignore=DL3013
RUN python -m pip install "grpcio==1.84.*" "grpcio-health-checking==1.84.*" "grpcio-reflection==1.84.*" \
    "protobuf>=7.35.1,<8" "numpy>=1.26" "prometheus-client>=0.20" "regex>=2023.0" \
    "boto3>=1.34" "redis>=5" "hiredis>=2"

# --- 3. the runtime image ------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 loraplex \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin loraplex \
 && mkdir -p /var/lib/loraplex/store \
 && chown 10001:10001 /var/lib/loraplex/store
COPY --from=venv /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    LORAPLEX_STORE_LISTEN=0.0.0.0:50061 \
    LORAPLEX_STORE_LOCAL_DIR=/var/lib/loraplex/store
USER 10001:10001
EXPOSE 50061
ENTRYPOINT ["loraplex-store"]
