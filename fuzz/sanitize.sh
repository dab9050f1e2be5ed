#!/usr/bin/env bash
# The whole test suite against an ASan + UBSan build of every extension (MCF_SANITIZE=1, see setup.py).
#
#   fuzz/sanitize.sh [CLONE_DIR] [pytest args...]     (default CLONE_DIR: /tmp/mcf-sanitize)
#
# It builds in a separate clone of the committed HEAD with `build_ext --inplace` and runs pytest from
# there, so the editable install of the main tree is never touched (`import mcf` resolves to the clone
# because pytest runs from its root).  The ASan and UBSan runtimes must be preloaded into the
# (uninstrumented) python; leak detection is off because CPython's interned objects look like leaks.
# UBSan is built with -fno-sanitize-recover: the first report aborts the run.  pytest runs with -s so a
# report is not swallowed by output capture when the process dies.
# Measured on the 2-core dev machine: build ~2 min, suite ~5-6 min (see docs/reliability.md).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/mcf-sanitize}
shift || true
start=$(date +%s)
if [ ! -d "$dir/.git" ]; then
    git clone -q "$repo" "$dir"
else
    git -C "$dir" fetch -q "$repo" HEAD && git -C "$dir" checkout -q --force FETCH_HEAD
fi
cd "$dir"
MCF_SANITIZE=1 python setup.py -q build_ext --inplace >build-sanitize.log 2>&1 || { tail -30 build-sanitize.log; exit 1; }
built=$(date +%s)
echo "sanitizer build: $((built - start)) s ($(git log --oneline -1))"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1
python -c 'import mcf, sys; assert mcf.__file__.startswith(sys.argv[1]), mcf.__file__' "$dir"
rc=0
python -m pytest -q -s -p no:cacheprovider "$@" || rc=$?
echo "sanitized suite: exit $rc in $(( $(date +%s) - built )) s"
exit $rc
