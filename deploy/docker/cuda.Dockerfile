# pdserve on NVIDIA GPUs: one image for every component, chosen by the command:
#   docker run --gpus all IMAGE router|prefill|decode|single [flags]   (settings also from PDSERVE_*)
# The CUDA runtime, cuBLAS, NCCL, triton and UCX come as PyPI wheels (torch, extras gpu and ucx); only the
# driver comes from the host, injected by the NVIDIA container toolkit (or the Kubernetes device plugin).
# Triton compiles its small launcher at run time, so the runtime stage keeps a C compiler.
# Weights are never in the image: mount them and point PDSERVE_MODEL at them.
# Build from the repository root:
#   docker build -f deploy/docker/cuda.Dockerfile -t pdserve:cuda .
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# the torch the project measures GPUs with (docs/benchmarks.md), and the one triton 3.6.0 (extra gpu) fits
ARG TORCH_VERSION=2.11.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH
# torch first, in its own layer: PyPI's default Linux wheel is the CUDA build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . /src
# extras of the pdserve package, e.g. "[gpu,ucx]"; torch pinned again so that pip never swaps it for another
ARG PDSERVE_EXTRAS="[gpu,ucx]"
RUN pip install --no-cache-dir "/src${PDSERVE_EXTRAS}" "torch==${TORCH_VERSION}" \
    && pdserve --help > /dev/null && kvctl --help > /dev/null

FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="pdserve (CUDA)" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving on NVIDIA GPUs: router, prefill, decode, single, kvctl"
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid pdserve --home-dir /home/pdserve --create-home --shell /usr/sbin/nologin pdserve \
    && mkdir -p /models && chown pdserve:pdserve /models
COPY --from=build /opt/pdserve /opt/pdserve
COPY --chmod=0755 deploy/docker/probe.py /usr/local/bin/pdserve-probe
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    TRITON_CACHE_DIR=/home/pdserve/.triton
USER 10001:10001
WORKDIR /home/pdserve
VOLUME ["/models"]
# router API 8000; a node's internal HTTP 8100; a decode node's KV-transfer listener 8200
# (ucx and nccl also open ephemeral ports between P and D)
EXPOSE 8000 8100 8200
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["pdserve-probe", "health"]
ENTRYPOINT ["pdserve"]
CMD ["--help"]
