#!/usr/bin/env bash
# The kernels on aarch64, from this x86-64 machine: cross-compile mcf's C kernels and Cython extensions for
# aarch64, then run the kernel tests under qemu-user with an aarch64 Python, once per forced variant and
# qemu CPU model.  NEON must give the scalar code's bits (tests/reference.py is the judge, as on x86);
# c-blosc2 shipped a NEON bitshuffle that was "still buggy", which is what this catches.
#
#   tools/qemu_arm64.sh                 # everything below (what .ci/run's step does)
#   tools/qemu_arm64.sh -k q4           # extra arguments go to every pytest run
#
# What it uses, all from Debian and PyPI (downloads cached under $MCF_CACHE_DIR/arm64, default
# ~/.cache/mcf/arm64):
#   - gcc-aarch64-linux-gnu and qemu-user (apt-get install, when missing);
#   - Debian's arm64 python3.11 and its libraries (apt-get download + dpkg -x into a sysroot: the headers
#     to compile against and the interpreter qemu runs with -L);
#   - the manylinux aarch64 wheels of numpy 2.x (headers and runtime), ml_dtypes, gguf, safetensors and
#     pytest / hypothesis, unpacked into one directory on PYTHONPATH.
# The build happens in a copy of the tracked files ($MCF_ARM64_BUILD, default a temporary directory), with
# the aarch64 sysconfig data so setup.py produces aarch64 extension modules, never touching the checkout.
#
# The runs (a focused subset: qemu runs 10-50x slower than native):
#   - detection: on each CPU model, kernel_info() reports neon as the best variant, an x86 variant is
#     refused (`mcf kernels` exits 2 with the message), and MCF_FORCE_IMPL=neon / =scalar take effect;
#   - KERNEL_TESTS on the first CPU model, -cpu neoverse-n1 (Graviton 2, Ampere Altra), with
#     MCF_FORCE_IMPL=neon and =scalar; the tests themselves also compare every supported variant
#     (kernel_info()["supported"]) with the reference, so each run checks scalar and neon both, and the
#     forced variable reaches the paths that take the default variant;
#   - QUICK_TESTS with MCF_FORCE_IMPL=neon on the others: -cpu max (every feature qemu has: SVE2, dotprod,
#     FP16...) and -cpu cortex-a53 (ARMv8.0: ASIMD only, no dotprod, no FP16 arithmetic: the floor the NEON
#     code is written for; it uses no optional feature, so there is no fallback path to test).  qemu
#     executes a given instruction the same way under every model, so these runs check that the code runs
#     and is detected on each, not new arithmetic.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
CACHE=${MCF_CACHE_DIR:-$HOME/.cache/mcf}/arm64
NUMPY_VERSION=2.2.6
CPUS=${MCF_QEMU_CPUS:-neoverse-n1 max cortex-a53}
# MCF_ARM64_TESTS overrides the list (space-separated; for a quick local check)
# shellcheck disable=SC2206
KERNEL_TESTS=(${MCF_ARM64_TESTS:-tests/test_fpconv.py tests/test_kernels.py tests/test_rounding.py
    tests/test_scaled_kernels.py tests/test_megacontext_q8.py tests/test_gguf_types.py tests/test_quant_search.py
    tests/test_gguf.py::test_decode_equals_gguf_py tests/test_gguf.py::test_every_access_mode_decodes_the_same
    tests/test_gguf.py::test_narrow_outputs_round_like_fpconv tests/test_gguf.py::test_golden_files
    tests/test_gguf.py::test_large_outputs_use_streaming_stores_with_the_same_bits
    tests/test_bucket_pages.py::test_crc32c_variants_match_the_reference})
# shellcheck disable=SC2206
QUICK_TESTS=(${MCF_ARM64_QUICK_TESTS:-tests/test_kernels.py tests/test_fpconv.py tests/test_gguf_types.py
    tests/test_scaled_kernels.py tests/test_megacontext_q8.py tests/test_bucket_pages.py::test_crc32c_variants_match_the_reference})
# qemu-user runs the aarch64 interpreter, but a child process it starts is exec'd by the host kernel, which
# cannot run an aarch64 binary without binfmt_misc: the one kernel-file test that spawns Python is left out
# (it checks tools/gen_gguf_tables.py's output, not a kernel)
DESELECT=(--deselect tests/test_gguf_types.py::test_table_generator_is_up_to_date)
DEBS=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev libc6 libgcc-s1 libstdc++6
      libexpat1 zlib1g libffi8 libbz2-1.0 liblzma5 libssl3 libsqlite3-0 libuuid1 libncursesw6 libtinfo6
      libreadline8 libcrypt1 libdb5.3 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3
      libkrb5support0 libcom-err2 libkeyutils1)
WHEELS=("numpy==$NUMPY_VERSION" pytest hypothesis ml_dtypes gguf safetensors)
say() { echo "qemu_arm64: $*" >&2; }

# -- tools ------------------------------------------------------------------------------------------------
apt_install() {  # a clean machine may have empty package lists: update once if the plain install fails
    timeout 600 apt-get install -y -q "$@" >/dev/null || { timeout 600 apt-get update -qq && timeout 600 apt-get install -y -q "$@" >/dev/null; }
}
command -v aarch64-linux-gnu-gcc >/dev/null || apt_install gcc-aarch64-linux-gnu
command -v qemu-aarch64 >/dev/null || apt_install qemu-user

# -- the aarch64 sysroot: Debian's arm64 Python ---------------------------------------------------------------
SYSROOT=$CACHE/sysroot
if [ ! -e "$SYSROOT/.complete" ]; then
    dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64 && timeout 600 apt-get update -qq; }
    mkdir -p "$CACHE/debs"
    (cd "$CACHE/debs" && timeout 600 apt-get download -q "${DEBS[@]/%/:arm64}" >/dev/null 2>&1) \
        || { timeout 600 apt-get update -qq && (cd "$CACHE/debs" && timeout 600 apt-get download -q "${DEBS[@]/%/:arm64}" >/dev/null); }
    rm -rf "$SYSROOT" && mkdir -p "$SYSROOT"
    for d in "$CACHE"/debs/*.deb; do dpkg -x "$d" "$SYSROOT"; done
    touch "$SYSROOT/.complete"
fi
PY="$SYSROOT/usr/bin/python3.11"

# -- the aarch64 wheels -------------------------------------------------------------------------------------
SITE=$CACHE/site-$NUMPY_VERSION-$(printf '%s\n' "${WHEELS[@]}" | cksum | cut -d' ' -f1)
if [ ! -e "$SITE/.complete" ]; then
    rm -rf "$SITE" "$CACHE/wheels" && mkdir -p "$SITE" "$CACHE/wheels"
    timeout 600 python -m pip download -q --only-binary=:all: --platform manylinux2014_aarch64 --python-version 3.11 \
        --implementation cp --abi cp311 -d "$CACHE/wheels" "${WHEELS[@]}"
    for w in "$CACHE"/wheels/*.whl; do python -m zipfile -e "$w" "$SITE"; done
    touch "$SITE/.complete"
fi

# -- cross-compile ------------------------------------------------------------------------------------------
BUILD=${MCF_ARM64_BUILD:-}
if [ -z "$BUILD" ]; then
    BUILD=$(mktemp -d "${TMPDIR:-/tmp}/mcf-arm64.XXXXXX")
    trap 'rm -rf "$BUILD"' EXIT
fi
mkdir -p "$BUILD/src" "$BUILD/sysconfig"
# the tracked files (as committed or edited in the checkout); --force below: a kept $MCF_ARM64_BUILD may hold
# objects built from another checkout, whose modification times say nothing about this one
git ls-files -z | (cd "$ROOT" && xargs -0 cp -p --parents -t "$BUILD/src")
cp "$SYSROOT/usr/lib/python3.11/_sysconfigdata__aarch64-linux-gnu.py" "$BUILD/sysconfig/"
say "cross-compiling in $BUILD/src"
(cd "$BUILD/src" && _PYTHON_SYSCONFIGDATA_NAME=_sysconfigdata__aarch64-linux-gnu _PYTHON_HOST_PLATFORM=linux-aarch64 \
    PYTHONPATH="$BUILD/sysconfig" \
    CFLAGS="-I$SYSROOT/usr/include/python3.11 -I$SYSROOT/usr/include -I$SITE/numpy/_core/include" \
    timeout 1800 python setup.py -q build_ext --inplace --force >"$BUILD/build.log" 2>&1) \
    || { tail -40 "$BUILD/build.log" >&2; say "the aarch64 build failed"; exit 1; }
n=$(find "$BUILD/src/mcf" -name '*.cpython-311-aarch64-linux-gnu.so' | wc -l)
[ "$n" -ge 9 ] || { say "the aarch64 build made $n extension modules, expected 9 or more"; exit 1; }

# -- run under qemu -----------------------------------------------------------------------------------------
arm() {  # arm CPU COMMAND...: the aarch64 Python under qemu-user with that CPU model
    local cpu=$1
    shift
    (cd "$BUILD/src" && PYTHONPATH="$BUILD/src:$BUILD/src/tests:$SITE" PYTHONDONTWRITEBYTECODE=1 \
        qemu-aarch64 -cpu "$cpu" -L "$SYSROOT" "$PY" "$@")
}
for cpu in $CPUS; do
    say "-cpu $cpu: detection and forcing"
    arm "$cpu" - <<'PYEOF'
import os, subprocess, sys
import mcf
from mcf.cli import main
info = mcf.kernel_info()
assert info["best"] == "neon" and info["supported"] == ["scalar", "neon"], info
for v in ("scalar", "neon"):
    os.environ["MCF_FORCE_IMPL"] = v
    assert mcf.kernel_info()["active"] == v
for bad in ("avx2", "avx512", "sse9"):
    os.environ["MCF_FORCE_IMPL"] = bad
    assert main(["kernels"]) == 2, bad
print("detection:", info)
PYEOF
done
run_tests() {  # run_tests CPU IMPL full|quick [pytest args]
    local cpu=$1 impl=$2 t0=$SECONDS
    local -a files
    if [ "$3" = full ]; then files=("${KERNEL_TESTS[@]}"); else files=("${QUICK_TESTS[@]}"); fi
    shift 3
    say "-cpu $cpu, MCF_FORCE_IMPL=$impl: ${files[*]}"
    MCF_FORCE_IMPL=$impl arm "$cpu" -m pytest -q -p no:cacheprovider "${files[@]}" "${DESELECT[@]}" "$@"
    say "-cpu $cpu, MCF_FORCE_IMPL=$impl: $((SECONDS - t0)) s"
}
first=1
for cpu in $CPUS; do
    if [ "$first" = 1 ]; then
        run_tests "$cpu" neon full "$@"
        run_tests "$cpu" scalar full "$@"
    else
        run_tests "$cpu" neon quick "$@"
    fi
    first=0
done
say "all runs passed"
