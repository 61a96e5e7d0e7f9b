#!/usr/bin/env bash
# Download the wheels `pagoda serve` needs that the lent H200 machine's Python lacks, into .whl/
# (git-ignored; carried to the device with the `run` tool's `carry`). The device has aiohttp,
# httpx, prometheus-client, anyio, h11, click, uvloop, jinja2, tokenizers and numpy already;
# these are the server's framework, its pydantic, fastapi's opentelemetry-api and a
# typing-extensions new enough for this pydantic; gguf (transformers' GGUF reader, the reference
# of benchmarks/gpu_real_weights.py), xgrammar and its apache-tvm-ffi (structured outputs), and
# py-spy (gpu_serve_bench.py --profile; its binary lands in /tmp/site/bin). One version each (two stop the install),
# the versions this checkout's tests run with. The device has no registry: install there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
mkdir -p "$DEST"
WHEELS=(
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    opentelemetry-api==1.45.2 typing-extensions==4.16.0
    gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 py-spy==0.4.3
)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
du -sh "$DEST"
ls "$DEST"
