#!/usr/bin/env bash
# aarch64 part of CI, on an x86_64 Debian 12 machine (run as root; see ../shared/ARM.md):
#   1. toolchain (g++-aarch64-linux-gnu, qemu-user-static, mmdebstrap), an arm64 Debian rootfs with
#      python3.11, and aarch64 wheels (torch, numpy, pytest, transformers, ...) in a site dir, all
#      cached under $ARMSERVE_ARM_CACHE (default ~/.cache/armserve-arm) so a second run is fast;
#   2. cross-builds the kernel library and stages an aarch64 copy of the armserve package;
#   3. runs the kernel tests (tests/test_kernels.py, ...) and tests_arm/ under qemu-aarch64-static,
#      each kernel variant at the emulated CPUs where its code or dispatch can differ (ARMSERVE_ARM_CPUS,
#      "cpu:variant+variant ..."; tests_arm/isa_filter.py deselects the other variants' cases):
#        neoverse-n1      scalar + neon  (NEON with dotprod, no bf16/i8mm/SVE: SDOT GEMM, fp32 bf16 dots)
#        max,sve128=on    neon + sve     (NEON's i8mm/BFDOT paths; SVE-128, which takes NEON's SMMLA tiles)
#        max,sve256=on    sve            (NEON and scalar code do not read the vector length)
#        max,sve512=on    sve
#      The scalar variant's code and dispatch do not depend on the CPU (csrc/dispatch.cpp variant_bf16,
#      qdispatch.cpp, dense_dispatch.cpp), so it runs once. Tests not parametrized by variant run at
#      every CPU with the CPU's best variant, and tests_arm/test_arm_isa.py checks features and
#      dispatch at every CPU. pytest's report must show exactly the listed variants, nothing skipped;
#   4. end to end, at each of those CPUs (ARMSERVE_ARM_E2E_CPUS): greedy tokens of a tiny random Llama
#      from armserve's engine with the aarch64 kernels on (each listed variant), equal to the tokens
#      the x86 run produced (ARMSERVE_ARM_REFERENCE: that run's JSON if already made).
# ARMSERVE_ARM_KERNEL_CPUS (default: all): the CPUs where the kernel tests run; elsewhere only tests_arm/.
# ARMSERVE_ARM_WHEEL=path/to/armserve-...-manylinux_*_aarch64.whl (scripts/ci_wheels.sh): step 2 installs
# that prebuilt wheel with pip instead of cross-building, and the tests run in a copy of the rootfs
# without libgomp (the wheel must run on the OpenMP runtime torch bundles alone).
# ARMSERVE_BUILD_CACHE (csrc/build.py): compiled objects shared with scripts/build_wheels.sh.
# About 9 minutes from cold on a quiet 2-core machine (apt included). The kernel tests run at full
# size; ARMSERVE_ARM_SMALL=1 shrinks them (ARMSERVE_TEST_SMALL).
# Logs (with each CPU's slowest tests): $ARMSERVE_ARM_CACHE/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$(date +%s)
t() { echo "[ci_arm64 $(($(date +%s) - T0))s] $*"; }

CACHE=${ARMSERVE_ARM_CACHE:-$HOME/.cache/armserve-arm}
ROOTFS=$CACHE/rootfs
SITE=$CACHE/site
TORCH_VERSION=2.9.1
CPUS=${ARMSERVE_ARM_CPUS:-"neoverse-n1:scalar+neon max,sve128=on:neon+sve max,sve256=on:sve max,sve512=on:sve"}
E2E_CPUS=${ARMSERVE_ARM_E2E_CPUS:-$CPUS}
KERNEL_CPUS=${ARMSERVE_ARM_KERNEL_CPUS:-$CPUS}
REFERENCE=${ARMSERVE_ARM_REFERENCE:-}
SMALL=${ARMSERVE_ARM_SMALL:-0}
WHEEL=${ARMSERVE_ARM_WHEEL:-}
# Kernel test files run at every CPU: tests parametrized by an `isa` fixture (ids `[neon-...]`).
KERNEL_TESTS=${ARMSERVE_ARM_KERNEL_TESTS:-"tests/test_kernels.py tests/test_quantized.py tests/test_kv_cache_int8.py tests/test_step_graph.py tests/test_dense_gemm.py tests/test_moe.py tests/test_lora_kernels.py"}
LOGS=$CACHE/logs
NICE="nice -n 10"  # two cores shared with other people
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$CACHE" "$LOGS"

# ---- 1. toolchain, rootfs, wheels ---------------------------------------------------------------
t "toolchain"
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64-static >/dev/null ||
  ! command -v mmdebstrap >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu qemu-user-static mmdebstrap >/dev/null
fi

# Each cached piece carries a stamp of its recipe; a changed recipe rebuilds it.
stamp_ok() { [ -f "$1/.armserve-stamp" ] && [ "$(cat "$1/.armserve-stamp")" = "$2" ]; }

ROOTFS_PKGS="python3,libstdc++6,libgomp1"
ROOTFS_STAMP="bookworm $ROOTFS_PKGS"
t "arm64 rootfs"
if ! stamp_ok "$ROOTFS" "$ROOTFS_STAMP"; then
  rm -rf "$ROOTFS" "$ROOTFS.tmp"
  $NICE mmdebstrap --quiet --arch=arm64 --variant=extract --include="$ROOTFS_PKGS" bookworm "$ROOTFS.tmp"
  # Debian ships no .pyc; compiling on the host saves seconds on every emulated start.
  $NICE python3 -m compileall -q -j0 "$ROOTFS.tmp/usr/lib/python3.11" >/dev/null || true
  echo "$ROOTFS_STAMP" >"$ROOTFS.tmp/.armserve-stamp"
  mv "$ROOTFS.tmp" "$ROOTFS"
fi

# Pure-Python and tokenizer packages at the x86 environment's versions (when it has them), so both
# sides tokenize and read the checkpoint alike.
hostver() { python3 -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true; }
pin() { local v; v=$(hostver "$1"); if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi; }
WHEELS="numpy pytest filelock typing-extensions>=4.10 sympy>=1.13.3 networkx jinja2 fsspec tqdm gguf
  $(pin transformers) $(pin tokenizers) $(pin huggingface_hub) $(pin safetensors)"
WHEELS=$(echo $WHEELS)
SITE_STAMP="torch==$TORCH_VERSION $WHEELS"
# Every manylinux tag bookworm's glibc 2.36 runs (pip 23 does not widen manylinux_2_28 to older
# tags itself, and e.g. tokenizers ships manylinux_2_17 wheels only).
PLATFORMS=(--platform manylinux2014_aarch64)
for g in $(seq 17 36); do PLATFORMS+=(--platform "manylinux_2_${g}_aarch64"); done
t "aarch64 wheels"
if ! stamp_ok "$SITE" "$SITE_STAMP"; then
  rm -rf "$SITE" "$SITE.tmp"
  PIPX=(python3 -m pip install -q --disable-pip-version-check --no-compile --target "$SITE.tmp" --only-binary=:all:
    "${PLATFORMS[@]}" --python-version 3.11 --implementation cp --abi cp311)
  # --no-deps: torch's declared dependencies chase x86-only nvidia packages; its real ones are in $WHEELS.
  $NICE "${PIPX[@]}" --no-deps "torch==$TORCH_VERSION"
  rm -rf "$SITE.tmp/bin"  # torch's console scripts; the next install would warn about the clash
  # shellcheck disable=SC2086
  $NICE "${PIPX[@]}" $WHEELS
  $NICE python3 -m compileall -q -j0 "$SITE.tmp" >/dev/null || true
  echo "$SITE_STAMP" >"$SITE.tmp/.armserve-stamp"
  mv "$SITE.tmp" "$SITE"
fi

# ---- 2. cross-build and stage the aarch64 package ------------------------------------------------
STAGE=$(mktemp -d /tmp/armserve-arm.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
RUN_ROOTFS=$ROOTFS
if [ -n "$WHEEL" ]; then
  t "install $(basename "$WHEEL")"
  # pip decides, as on a bookworm machine, whether the wheel's tag fits; no compiler is involved.
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$STAGE" \
    --only-binary=:all: "${PLATFORMS[@]}" --python-version 3.11 --implementation cp --abi cp311 "$WHEEL"
  export ARMSERVE_EXPECT_LIBRARY=$STAGE/armserve/_C.so
  [ -f "$ARMSERVE_EXPECT_LIBRARY" ] || { echo "ci_arm64: the wheel has no armserve/_C.so"; exit 1; }
  # The rootfs without the system libgomp (hard links: cheap), so only torch's runtime can serve.
  RUN_ROOTFS=$CACHE/rootfs-nogomp
  rm -rf "$RUN_ROOTFS"
  cp -al "$ROOTFS" "$RUN_ROOTFS"
  rm -f "$RUN_ROOTFS"/usr/lib/aarch64-linux-gnu/libgomp*
else
  t "cross-build kernels"
  tar -C "$REPO" --exclude='*.so' --exclude=__pycache__ -cf - armserve | tar -C "$STAGE" -xf -
  $NICE python3 csrc/build.py --cxx aarch64-linux-gnu-g++ --arch aarch64 \
    --out "$STAGE/armserve/_C.cpython-311-aarch64-linux-gnu.so" >/dev/null
  rm -rf "$STAGE/armserve/.build-aarch64"
fi
python3 -m compileall -q "$STAGE/armserve" >/dev/null || true

# ---- 4a. the x86 side of the end-to-end check ----------------------------------------------------
if [ -z "$REFERENCE" ]; then
  t "x86 reference tokens"
  REFERENCE=$STAGE/e2e_reference.json
  $NICE python3 tests_arm/e2e_reference.py "$REFERENCE"
fi

# ---- 3 + 4b. tests under emulation ----------------------------------------------------------------
# PYTHONSAFEPATH: `python -m pytest` must not put the repo (with its x86 _C.so) before $STAGE; tests_arm
# is on the path for the isa_filter plugin. ARMSERVE_ARM_ISAS: the variants tested at this CPU.
run_arm() { # cpu isas log pytest-args...
  local cpu=$1 isas=$2 log=$3
  shift 3
  QEMU_CPU=$cpu ARMSERVE_EXPECT_CPU=$cpu ARMSERVE_ARM_ISAS=$isas ARMSERVE_TEST_SMALL=$SMALL \
    ARMSERVE_E2E_REFERENCE="$REFERENCE" PYTHONSAFEPATH=1 PYTHONPATH="$STAGE:$SITE:$REPO/tests_arm" \
    PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=2 \
    $NICE qemu-aarch64-static -L "$RUN_ROOTFS" "$RUN_ROOTFS/usr/bin/python3.11" \
    -m pytest -v -rP -p no:cacheprovider -p isa_filter --durations=15 -o addopts= "$@" >"$log" 2>&1
}
# "cpu:isa+isa" -> cpu; its variants (without ":": every variant the CPU runs).
cpu_of() { echo "${1%%:*}"; }
isas_of() {
  case $1 in
    *:*) echo "${1#*:}" | tr '+' ' ' ;;
    neoverse-n1) echo "scalar neon" ;;
    *) echo "scalar neon sve" ;;
  esac
}
in_list() { # cpu list: whether the list names cpu (with or without ":variants")
  local e
  for e in $2; do [ "$(cpu_of "$e")" = "$1" ] && return 0; done
  return 1
}

FAILED=0
for spec in $CPUS; do
  cpu=$(cpu_of "$spec")
  want=$(isas_of "$spec")
  tests=()
  kernel_tests=0
  if in_list "$cpu" "$KERNEL_CPUS"; then
    # shellcheck disable=SC2206
    tests=($KERNEL_TESTS)
    kernel_tests=1
  fi
  tests+=(tests_arm/test_arm_isa.py)
  e2e=0
  if in_list "$cpu" "$E2E_CPUS"; then tests+=(tests_arm/test_arm_e2e.py); e2e=1; fi
  log=$LOGS/pytest-${cpu//[,=]/_}.log
  t "tests at -cpu $cpu (${tests[*]}), expecting ISAs: $want"
  status=0
  # Tests that need a model (needs_model: the bundled SmolLM2 package) are covered here by
  # test_arm_e2e.py, which compares the engine's tokens with the x86 run's. spawns_python: user-mode
  # QEMU cannot exec the rootfs interpreter as a child (no binfmt_misc on CI machines).
  run_arm "$cpu" "$want" "$log" "${tests[@]}" -m "not needs_model and not spawns_python" || status=$?
  tail -n 1 "$log"
  if [ $status -ne 0 ]; then
    grep -E "FAILED|ERROR|Error|assert" "$log" | head -n 60 || true
    FAILED=1
    continue
  fi
  # The report must show every expected variant exercised (kernel tests are parametrized by ISA),
  # no other (one this CPU lacks, or one tested at another CPU), and nothing skipped.
  if grep -qE " SKIPPED| XFAIL| XPASS" "$log"; then
    echo "tests were skipped at -cpu $cpu:"; grep -E " SKIPPED| XFAIL| XPASS" "$log"; FAILED=1
  fi
  for isa in scalar neon sve; do
    n=$(grep -cE "^tests/test_[a-z0-9_]+\.py::[a-z0-9_]+\[($isa\]|$isa-).* PASSED" "$log" || true)
    case " $want " in
      *" $isa "*)
        if [ $kernel_tests -eq 1 ] && [ "$n" -eq 0 ]; then echo "no $isa kernel test passed at -cpu $cpu"; FAILED=1; fi
        if [ $e2e -eq 1 ] && ! grep -qE "^-cpu $cpu $isa: tokens equal" "$log"; then
          echo "no end-to-end check of $isa at -cpu $cpu"; FAILED=1
        fi ;;
      *) [ "$n" -eq 0 ] || { echo "$n $isa kernel tests ran at -cpu $cpu, which should not run them"; FAILED=1; } ;;
    esac
    echo "  $isa: $n kernel tests passed"
  done
  grep -E "^tests_arm/.* PASSED|^-cpu " "$log" | sed 's/^/  /' || true
done
t "done"
if [ $FAILED -ne 0 ]; then
  echo "ci_arm64: FAILED"
  exit 1
fi
echo "ci_arm64: all aarch64 checks passed"
