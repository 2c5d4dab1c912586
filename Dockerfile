# syntax=docker/dockerfile:1
# nemo_rl images. The default target is the GPU image; `cpu` runs the embedded default on any machine.
#
#   docker build -t nemo-rl:latest .                                   # GPU: CUDA base, the vllm extra
#   docker build -t nemo-rl:latest --build-arg MCORE=1 --build-arg TE=1 .   # + megatron-core, Transformer Engine
#   docker build -t nemo-rl:cpu --target cpu .                         # CPU only
#   docker run --rm --shm-size=2g nemo-rl:cpu                          # tiny GRPO on the embedded default
#
# Both install exactly what the README and CI install: uv from PyPI, then `uv sync --locked` (with extras) into
# a virtual environment at /opt/nemo_rl_venv, on PATH; the source lives in /opt/nemo_rl.
# tests/unit/test_dockerfile.py keeps these commands and the README's in step. docs/cluster.md has more.

# The CUDA base: a tag of NVIDIA's CUDA image that matches the CUDA 13 wheels torch pulls in (devel: the te
# extra compiles against the toolkit). The CPU base: any Debian with Python 3.11 (the version in .python-version).
ARG BASE_IMAGE=nvcr.io/nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm
ARG UV_VERSION=0.13.9

########################################################################################################################
# cpu: Debian + Python 3.11, the locked environment without GPU extras.
########################################################################################################################
FROM ${CPU_BASE_IMAGE} AS cpu
ARG UV_VERSION
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV UV_PROJECT_ENVIRONMENT=/opt/nemo_rl_venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    PATH=/opt/nemo_rl_venv/bin:$PATH \
    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 \
    RAY_USAGE_STATS_ENABLED=0 \
    PYTHONUNBUFFERED=1
# bubblewrap: the code sandbox's default isolation (without it, code environments and the python tool refuse
# to start; docs/security.md). A Debian base without pip (debootstrap) gets Debian's; the official Python image
# already has one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && if ! python3 -m pip --version >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3-pip ca-certificates; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m pip install --no-cache-dir --break-system-packages "uv==${UV_VERSION}"
WORKDIR /opt/nemo_rl
# Dependencies first (a layer that changes only with the lock), then the project itself.
COPY pyproject.toml uv.lock .python-version ./
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-install-project
COPY . .
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked
CMD ["uv", "run", "python", "examples/run_grpo_math.py", "--config", "examples/configs/grpo_math_tiny_main.yaml"]

########################################################################################################################
# gpu (default): the CUDA base, the vllm extra; MCORE=1 / TE=1 add megatron-core / Transformer Engine.
########################################################################################################################
FROM ${BASE_IMAGE} AS gpu
ARG UV_VERSION
ARG MCORE=0
ARG TE=0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The interpreter comes from uv (.python-version) into a path every user can read.
ENV UV_PROJECT_ENVIRONMENT=/opt/nemo_rl_venv \
    UV_PYTHON_INSTALL_DIR=/opt/uv-python \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    PATH=/opt/nemo_rl_venv/bin:$PATH \
    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 \
    RAY_USAGE_STATS_ENABLED=0 \
    PYTHONUNBUFFERED=1
# git: Hugging Face and W&B read repository state; bubblewrap: the code sandbox's default isolation (the
# container must allow it namespaces, docs/security.md); the rest is what pip and the te build need.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates git bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m pip install --no-cache-dir --break-system-packages "uv==${UV_VERSION}"
WORKDIR /opt/nemo_rl
COPY pyproject.toml uv.lock .python-version ./
RUN --mount=type=cache,target=/root/.cache/uv \
    set -- --extra vllm; \
    if [ "${MCORE}" = 1 ]; then set -- "$@" --extra mcore; fi; \
    if [ "${TE}" = 1 ]; then set -- "$@" --extra te; fi; \
    uv sync --locked --no-install-project "$@"
COPY . .
RUN --mount=type=cache,target=/root/.cache/uv \
    set -- --extra vllm; \
    if [ "${MCORE}" = 1 ]; then set -- "$@" --extra mcore; fi; \
    if [ "${TE}" = 1 ]; then set -- "$@" --extra te; fi; \
    uv sync --locked "$@"
CMD ["bash"]
