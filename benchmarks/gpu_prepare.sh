#!/bin/bash
# On this machine, before a GPU session: what `benchmarks/gpu_check.sh` needs on a GPU machine that has Python 3.12,
# PyTorch (CUDA), transformers and Triton but no network and no Redis:
#   .gpu-pack/  wheels of the light dependencies (redis, rq, pydantic, ...) and py-spy, at this machine's versions,
#               and this machine's redis-server with the shared libraries it links; `source .gpu-pack/activate.sh`
#               there installs the wheels under /tmp/site and puts redis-server on PATH;
#   .gpu-model/smollm2-tok/  SmolLM2-135M-Instruct's tokenizer (chat template included), for the queue rows.
# Both are git-ignored; carry them with the device tool: carry [".gpu-pack", ".gpu-model"] (about 25 MB).
# Usage: bash benchmarks/gpu_prepare.sh        then, on the GPU: bash benchmarks/gpu_check.sh [all|queue|tests|smol|1b|...]
set -eu
cd "$(dirname "$0")/.."
pack=.gpu-pack
rm -rf "$pack" && mkdir -p "$pack/whl" "$pack/redis"
names="redis rq pydantic pydantic_core pydantic-settings annotated-types typing-inspection python-dotenv croniter hiredis
fakeredis typing_extensions py-spy prometheus-client llguidance pytest-xdist execnet"  # prometheus-client: the worker
# imports it; llguidance: structured outputs; pytest-xdist: pyproject's addopts name its --dist
specs=$(python3 - $names <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$pack/whl" $specs
server=$(readlink -f "$(command -v redis-server)")
cp "$server" "$pack/redis/redis-server"
# The C library and the loader stay the GPU machine's own; everything else redis-server links comes along.
ldd "$server" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$pack/redis/"; done
cat >"$pack/activate.sh" <<'SH'
# Sourced on the GPU machine: the wheels into /tmp/site, redis-server (with its own libraries) on PATH.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:/tmp/redis-bin:$PATH
mkdir -p /tmp/redis-bin
# With the carried libraries; where one of them wants a newer C library than the machine's, with the machine's own.
printf '#!/bin/sh\nif LD_LIBRARY_PATH=%s %s --version >/dev/null 2>&1; then export LD_LIBRARY_PATH=%s; fi\nexec %s "$@"\n' \
  "$here/redis" "$here/redis/redis-server" "$here/redis" "$here/redis/redis-server" >/tmp/redis-bin/redis-server
chmod +x /tmp/redis-bin/redis-server "$here/redis/redis-server"
SH
python3 - <<'PY'
from transformers import AutoTokenizer

from roseinfer.config import DEFAULT_MODEL
from roseinfer.model_loader import resolve_model

AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL)).save_pretrained(".gpu-model/smollm2-tok")
PY
du -sh "$pack" .gpu-model
# Every command line gpu_check.sh will run, parsed here: a flag a command no longer takes is found now, not on the GPU.
GPU_CHECK_PARSE_ONLY=1 bash benchmarks/gpu_check.sh queue tests smol 1b timeline queue-profile >/dev/null
echo "gpu_check.sh's command lines parse"
