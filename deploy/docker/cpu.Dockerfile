# pdserve on the CPU: one image for every component, chosen by the command:
#   docker run IMAGE router|prefill|decode|single [flags]   (settings also from PDSERVE_* variables)
# Weights are never in the image: mount them (e.g. at /models) and point PDSERVE_MODEL at the GGUF file
# or the Hugging Face directory. Secrets come from PDSERVE_*_FILE files or the environment, never argv.
# Build from the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t pdserve:cpu .
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH
# torch first, in its own layer: the CPU wheel (a bare `torch` from PyPI is the multi-GB CUDA build).
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . /src
# extras of the pdserve package, e.g. "[gpu,ucx]"; torch pinned again so that pip never swaps it for another
ARG PDSERVE_EXTRAS=""
RUN pip install --no-cache-dir "/src${PDSERVE_EXTRAS}" "torch==${TORCH_VERSION}" \
    && pdserve --help > /dev/null && kvctl --help > /dev/null

FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="pdserve (CPU)" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving: router, prefill, decode, single, kvctl"
RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid pdserve --home-dir /home/pdserve --create-home --shell /usr/sbin/nologin pdserve \
    && mkdir -p /models && chown pdserve:pdserve /models
COPY --from=build /opt/pdserve /opt/pdserve
COPY --chmod=0755 deploy/docker/probe.py /usr/local/bin/pdserve-probe
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
WORKDIR /home/pdserve
VOLUME ["/models"]
# router API 8000; a node's internal HTTP 8100; a decode node's KV-transfer listener 8200
EXPOSE 8000 8100 8200
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["pdserve-probe", "health"]
ENTRYPOINT ["pdserve"]
CMD ["--help"]
