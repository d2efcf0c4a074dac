# syntax=docker/dockerfile:1
#
# matmul-service on an NVIDIA GPU:   docker compose up   (or: docker build -t matmul-service . &&
#                                    docker run --gpus all -p 8000:8000 -p 8001:8001 -v cupy-cache:/var/cache/cupy
#                                    matmul-service)
#
# CUDA user-space comes from PyPI, not from the base image. CuPy compiles our kernels with NVRTC when the
# service starts, and NVRTC needs the CUDA headers (cuda_fp16.h, cuda_runtime.h, ...): the official
# `-runtime-` images have NVRTC and cuBLAS but no headers, and the `-devel-` ones add them with nvcc and
# several GB we never use. The build installs the three CUDA wheels the service loads, which CuPy finds by
# itself: the runtime with its headers, NVRTC and cuBLAS, of the CUDA release the base image is tagged with
# (CUDA_WHEELS; 12.8 needs driver 570 or later, or the forward-compatibility package the base image sets up).
# `cupy-cuda12x[ctk]` would add cuSOLVER, cuSPARSE, cuFFT and cuRAND (1.4 GB nothing here uses). So the base is
# the small official `-base-` image, which brings what the NVIDIA container runtime expects
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES, the CUDA compat setup), and the host supplies the driver.
#
# Without a registry (CI): CUDA_IMAGE and PYTHON_IMAGE may name any Debian or Ubuntu image with python3-venv
# available; `make container-test` builds and runs the image on such a stand-in (tests/container).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG PYTHON_IMAGE=python:3.12-slim

# ---------------------------------------------------------------------------------------------- build
FROM ${CUDA_IMAGE} AS build
# Python 3.12 as the Ubuntu release behind the pinned base tag ships it (DL3008: no per-package pins).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client client
COPY app app
COPY kernels kernels
COPY numerics numerics
ARG CUDA_WHEELS=12.8.*
RUN /opt/venv/bin/pip install ./client ".[gpu]" "nvidia-cuda-runtime-cu12==${CUDA_WHEELS}" \
    "nvidia-cuda-nvrtc-cu12==${CUDA_WHEELS}" "nvidia-cublas-cu12==${CUDA_WHEELS}"
# Every kernel compiled here, for the devices of KERNEL_DEVICES (compute capabilities: A100, A10, L4/L40S, H100/H200),
# into the package (kernels/prebuilt): a container's first start on them loads machine code instead of compiling it
# (NVRTC needs no GPU). Another device compiles its kernels at start-up, into MATMUL_KERNEL_CACHE_DIR.
ARG KERNEL_DEVICES="8.0 8.6 8.9 9.0"
# -P: the installed package's kernels/prebuilt, not this folder's copy of the sources, which the image leaves behind
RUN /opt/venv/bin/python -P -m kernels.prebuild ${KERNEL_DEVICES}

# ------------------------------------------------------------- loadtest (docker compose --profile loadtest)
FROM ${PYTHON_IMAGE} AS loadtest
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /loadtest
COPY pyproject.toml README.md ./
COPY client client
COPY app app
COPY kernels kernels
COPY numerics numerics
COPY matmul_tools matmul_tools
COPY scripts/loadtest.py scripts/loadtest.py
# The versions are the project's own, in pyproject.toml (DL3013: no pins on the command line). A virtualenv, so that
# a Debian python3 (PEP 668) installs as python:3.12-slim's does.
# hadolint ignore=DL3013
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install ./client ".[loadtest]" \
 && groupadd --system --gid 10002 loadtest \
 && useradd --system --uid 10002 --gid 10002 --create-home loadtest \
 && mkdir /reports && chown 10002:10002 /reports
USER 10002:10002
ENTRYPOINT ["/opt/venv/bin/python", "scripts/loadtest.py"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------- service
FROM ${CUDA_IMAGE} AS service
# The same python3 as the build stage, so that the venv copied from there finds its interpreter.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 matmul \
 && useradd --system --uid 10001 --gid 10001 --create-home matmul \
 && mkdir -p /var/cache/cupy && chown 10001:10001 /var/cache/cupy
COPY --from=build /opt/venv /opt/venv
# Kernels are compiled (and this cache filled) at start-up, before /readyz says ready; the volume keeps
# them compiled across restarts. On SIGTERM (docker stop) the HTTP workers stop accepting and give in-flight
# requests UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN seconds (matmul-service reads it for --timeout-graceful-shutdown),
# then the engine processes drain; compose's stop_grace_period is longer, so no SIGKILL comes first.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CUPY_CACHE_DIR=/var/cache/cupy \
    MATMUL_BACKEND=gpu \
    UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN=30
VOLUME ["/var/cache/cupy"]
USER 10001:10001
WORKDIR /home/matmul
# 8000: HTTP (the routes and the inference protocol); 8001: the inference protocol over gRPC (MATMUL_GRPC_PORT)
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
# matmul-service starts one engine process per GPU and MATMUL_HTTP_WORKERS uvicorn workers in front of them, on
# 0.0.0.0:8000, with the connection protocol that bounds request headers (MATMUL_MAX_HEADER_BYTES,
# MATMUL_HEADER_TIMEOUT_S) and without uvicorn's plain access log (the service writes its own, in JSON:
# MATMUL_ACCESS_LOG). Settings come from the environment (MATMUL_*). The workers share memory with the engines
# through memfd arenas (MATMUL_SLAB_BYTES each), not /dev/shm, so the container needs no --shm-size. In exec form
# matmul-service is PID 1 and gets docker stop's SIGTERM itself.
CMD ["matmul-service"]
