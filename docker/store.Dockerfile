# syntax=docker/dockerfile:1
# The loraplex adapter store sidecar (loraplex-store) on slim Python. The chart also runs
# its fetch-model init container (S3 -> the pod) with this image's Python and boto3.
#
#   docker build -f docker/store.Dockerfile -t loraplex/store:0.1.0 .
#
# The install commands are the README's and CI's (Makefile `setup`, .ci/run): torch first,
# then the project (here its wheel, with the s3 and redis extras). The store never imports
# torch, but the project depends on it: the CPU build from PyTorch's CPU index (the
# Makefile's TORCH_INDEX_URL) keeps the image small. tests/test_dockerfiles.py checks these
# commands against the Makefile and .ci/run and builds the wheel the same way.

ARG PYTHON_IMAGE=python:3.11-slim

# --- 1. the project's wheel (its build hook generates the gRPC code from protos/) --------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# --- 2. a virtual environment: torch (CPU), the wheel -------------------------------------
FROM ${PYTHON_IMAGE} AS venv
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /dist /dist
# DL3013 cannot see the pins: torch is pinned by TORCH_SPEC, the project is the local wheel.
# hadolint ignore=DL3013
RUN python -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
# hadolint ignore=DL3013
RUN set -- /dist/loraplex-*.whl && python -m pip install "$1[s3,redis]"

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
