#!/usr/bin/env bash
# The carry kit for runs on a lent GPU machine (no network there; 64 MiB travel per call).
#
#   benchmarks/device_kit.sh build KIT [TREE]   (here, with network) fills the ignored folder KIT with the
#       wheels pdserve needs beyond the GPU image (FastAPI stack, Redis client, gguf, pydantic-settings,
#       py-spy), Debian's redis-server and its libraries as .deb files, this script, and, with TREE, a copy
#       of that git tree's tracked and untracked-not-ignored files (KIT/src), so a worktree other than the
#       one the device copies can run there. Fails if KIT would exceed the carry limit.
#   source KIT/device_kit.sh boot KIT   (there) installs the wheels into KIT/site, unpacks redis-server into
#       KIT/root, exports PYTHONPATH and PATH, links KIT/src/.build/pdserve, starts one redis-server on
#       KIT_REDIS_PORT (default 6399, for scripts that want a standing one; pdserve's launcher starts its
#       own per cluster) and prints what it found. Idempotent within one machine.
#   benchmarks/device_kit.sh ucx UCXKIT   (here) fills a second ignored folder with the UCX stack (ucxx and its
#       libraries, 51 MiB: carried beside KIT, the two fill most of a call); `boot KIT UCXKIT` installs it too.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then set -euo pipefail; fi  # not when sourced (boot)

KIT_LIMIT_MIB=${KIT_LIMIT_MIB:-56}   # leaves room for the device's copy of the checkout itself
# What the CUDA image lacks (KINDS.md lists what it has): exact versions, as tested here.
KIT_WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 pydantic-settings==2.14.1
  python-dotenv==1.2.2 typing-inspection==0.4.2 annotated-types==0.7.0 annotated-doc==0.0.7
  opentelemetry-api==1.45.2 uvicorn==0.54.0 redis==8.1.0 hiredis==3.5.0 gguf==0.19.0 py-spy==0.4.3
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pyzmq==27.3.0
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 idna==3.20 crc32c==2.9.post0
)
KIT_DEBS=(redis-server redis-tools libjemalloc2 liblzf1 libatomic1)
# The image has cuda-core, cuda-bindings, cuda-pathfinder and nvidia-ml-py; the rest of ucxx's stack:
KIT_UCX_WHEELS=(
  ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0
  rapids-logger==0.3.0
)

kit_ucx() {
  mkdir -p "$1"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    -d "$1" "${KIT_UCX_WHEELS[@]}"
  echo "ucx kit $1: $(du -sm "$1" | cut -f1) MiB"
}

kit_build() {
  local kit=$1 tree=${2:-}
  mkdir -p "$kit/whl" "$kit/deb"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$kit/whl" "${KIT_WHEELS[@]}"
  (cd "$kit/deb" && ls ./*.deb >/dev/null 2>&1 || apt-get download "${KIT_DEBS[@]}")
  cp "${BASH_SOURCE[0]}" "$kit/device_kit.sh"
  if [ -n "$tree" ]; then
    rm -rf "$kit/src" && mkdir -p "$kit/src"
    (cd "$tree" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -C "$kit/src" -xf -
  fi
  local mib
  mib=$(du -sm "$kit" | cut -f1)
  echo "kit $kit: ${mib} MiB ($(ls "$kit/whl" | wc -l) wheels, $(ls "$kit/deb" | wc -l) debs)"
  if [ "$mib" -gt "$KIT_LIMIT_MIB" ]; then
    echo "kit $kit is ${mib} MiB, over ${KIT_LIMIT_MIB} MiB: drop something" >&2
    return 1
  fi
}

kit_boot() {
  local kit
  kit=$(cd "$1" && pwd)
  if [ -n "${2:-}" ]; then
    local ucx
    ucx=$(cd "$2" && pwd)
    [ -d "$ucx/site" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$ucx/site" "$ucx"/*.whl
    export PYTHONPATH="$ucx/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if [ ! -d "$kit/site" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$kit/site" \
      "$kit"/whl/*.whl
  fi
  if [ ! -x "$kit/root/usr/bin/redis-server" ]; then
    for f in "$kit"/deb/*.deb; do dpkg -x "$f" "$kit/root"; done
  fi
  export PATH="$kit/root/usr/bin:$kit/site/bin:$PATH"
  export LD_LIBRARY_PATH="$kit/root/usr/lib/x86_64-linux-gnu:$kit/root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$kit/site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  # NVLink multicast stays off (KINDS.md): set here too, so every process we start inherits it
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [ -d "$kit/src" ]; then
    mkdir -p "$kit/src/.build" && ln -sfn .. "$kit/src/.build/pdserve"
  fi
  local port=${KIT_REDIS_PORT:-6399}
  if ! redis-cli -p "$port" ping >/dev/null 2>&1; then
    redis-server --port "$port" --save '' --appendonly no --daemonize yes \
      --logfile "$kit/redis-$port.log" >/dev/null
  fi
  echo "kit: $(redis-server --version | cut -d' ' -f1-3), redis on :$port $(redis-cli -p "$port" ping)," \
    "python $(python3 -c 'import sys, fastapi, torch; print(sys.version.split()[0], "fastapi", fastapi.__version__, "torch", torch.__version__)')"
}

kit_stop_redis() {
  redis-cli -p "${KIT_REDIS_PORT:-6399}" shutdown nosave >/dev/null 2>&1 || true
}

case "${1:-}" in
  build) shift; kit_build "$@" ;;
  boot) shift; kit_boot "$@" ;;
  ucx) shift; kit_ucx "$@" ;;
  stop) kit_stop_redis ;;
  *) echo "usage: device_kit.sh build KIT [TREE] | ucx UCXKIT | boot KIT [UCXKIT] | stop" >&2; return 2 2>/dev/null || exit 2 ;;
esac
