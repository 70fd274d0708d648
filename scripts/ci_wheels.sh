#!/usr/bin/env bash
# Prebuilt-wheel part of CI (after scripts/setup.sh, on an x86_64 Debian 12 machine, as root):
#   1. bash scripts/build_wheels.sh: the x86_64 and aarch64 wheels into dist/;
#   2. x86_64: greedy tokens of a tiny random Llama from the source build (tests_arm/e2e_reference.py),
#      then the x86_64 wheel installed by pip into a fresh virtualenv (dependencies from the index,
#      binary wheels only) and run there with a PATH that holds only that venv's bin/ (no g++, no
#      cc): `armserve info` must name the variants, scripts/wheel_smoke.py must see the wheel's
#      kernels (AVX-512 or AVX2 in use) generate the source build's tokens;
#   3. aarch64: scripts/ci_arm64.sh with ARMSERVE_ARM_WHEEL: the aarch64 wheel installed into the
#      QEMU site instead of a cross-build, rootfs without libgomp. At -cpu max,sve128=on the kernel
#      tests (tests/test_kernels.py) of each variant the wheel holds (scalar, NEON, SVE), the dispatch
#      checks (tests_arm/test_arm_isa.py) and the end-to-end check of each variant; at neoverse-n1
#      (NEON without bf16/i8mm/SVE) the dispatch checks and NEON's end-to-end check. The full kernel
#      suite at every CPU is ci_arm64.sh's job, on the library the wheel was made from (with
#      ARMSERVE_BUILD_CACHE, the very objects: csrc/build.py).
# About 10 minutes on a quiet 2-core machine with the ARM cache warm (wheels ~1-4, venv ~2, QEMU ~5).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$(date +%s)
t() { echo "[ci_wheels $(($(date +%s) - T0))s] $*"; }
NICE="nice -n 5"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

t "build wheels"
bash scripts/build_wheels.sh
X86=$(ls "$REPO"/dist/armserve-*-py3-none-manylinux_*_x86_64.whl)
ARM=$(ls "$REPO"/dist/armserve-*-py3-none-manylinux_*_aarch64.whl)

WORK=$(mktemp -d /tmp/armserve-ci-wheels.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
t "x86_64: source build's reference tokens"
$NICE python3 tests_arm/e2e_reference.py "$WORK/reference.json"

t "x86_64: $(basename "$X86") into a fresh venv, PATH without compilers"
VENV=$WORK/venv
python3 -m venv "$VENV"
# The rest of the environment (pip's index settings) as it is, but no PYTHONPATH: a caller's (a source
# checkout's, say) would be imported before the wheel.
NOCC=(env -u PYTHONPATH PATH="$VENV/bin")
"${NOCC[@]}" python -m pip install -q --only-binary=:all: "$X86" 2>&1 |
  { grep -v "^WARNING: Location 'file://" || true; }
# Run from an empty directory: nothing of the repository may be imported.
(cd "$WORK" && "${NOCC[@]}" armserve info | tee "$WORK/info.txt")
grep -q "built in: scalar, avx2, avx512, amx_bf16;" "$WORK/info.txt"
grep -qE "in use: (avx512|avx2)$" "$WORK/info.txt"
(cd "$WORK" && $NICE "${NOCC[@]}" OMP_NUM_THREADS=2 python "$REPO/scripts/wheel_smoke.py" "$WORK/reference.json")

t "aarch64: $(basename "$ARM") under QEMU"
# The x86 reference tokens are the ones made above (the same source build).
ARMSERVE_ARM_WHEEL=$ARM ARMSERVE_ARM_REFERENCE=$WORK/reference.json \
  ARMSERVE_ARM_CPUS=${ARMSERVE_ARM_CPUS:-"max,sve128=on:scalar+neon+sve neoverse-n1:neon"} \
  ARMSERVE_ARM_KERNEL_CPUS=${ARMSERVE_ARM_KERNEL_CPUS:-max,sve128=on} \
  ARMSERVE_ARM_KERNEL_TESTS=${ARMSERVE_ARM_KERNEL_TESTS:-tests/test_kernels.py} bash scripts/ci_arm64.sh
t "ci_wheels: both wheels passed"
