#!/usr/bin/env bash
# Wheels for `scripts/gpu-check.sh --wheels DIR` on a GPU machine without network (docs/gpu.md):
#
#   scripts/gpu-wheels.sh [DIR] [PYTHON_VERSION]        # defaults: .whl 3.12
#
# Downloads, for that Python on x86-64 Linux, the packages the check's parts import that a GPU
# image with PyTorch commonly lacks, at the versions this checkout's .venv has (torch, numpy,
# tokenizers, jinja2, rich, msgpack, httpx and their needs are expected there). No dependencies
# are resolved: the list is the whole set. A few MB.
set -eu
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${2:-3.12}
PACKAGES="gguf pydantic pydantic-core annotated-types typing-inspection tensorboardX
pytest iniconfig pluggy packaging pygments"
pins=$(.venv/bin/python - $PACKAGES <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
EOF
)
mkdir -p "$dir"
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086 # the pins and platforms are lists
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp $platforms -d "$dir" $pins
ls -la "$dir"
