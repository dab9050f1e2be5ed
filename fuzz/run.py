#!/usr/bin/env python
"""Long, coverage-guided fuzz runs of one target with atheris (libFuzzer).

    python fuzz/run.py --target mcf --seconds 600
    python fuzz/run.py --target megatron --runs 1000000 --jobs 2
    python fuzz/run.py --list

The corpus lives in ``fuzz/corpus/<target>/`` (created and seeded from the golden fixtures on first use;
not committed).  Failures are written to ``fuzz/crashes/<target>/`` by libFuzzer: copy each one into
``tests/fuzz_regressions/<target>/`` once fixed, so the test suite replays it forever.

A failure is any exception but :class:`mcf.MCFError` escaping the target, a signal (segfault, abort,
sanitizer report), one input running over ``--timeout`` seconds (default 1) or the process growing past
``--rss-limit-mb`` (default 2048).  The pure-Python parsers are instrumented for coverage; the compiled
kernels are not (use an ``MCF_SANITIZE=1`` build, see ``fuzz/sanitize.sh``, to catch memory errors there).
Extra arguments after ``--`` go to libFuzzer unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="one of --list")
    ap.add_argument("--seconds", type=int, help="total run time (libFuzzer -max_total_time)")
    ap.add_argument("--runs", type=int, help="number of executions (libFuzzer -runs)")
    ap.add_argument("--timeout", type=int, default=1, help="seconds one input may take (default 1)")
    ap.add_argument("--rss-limit-mb", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=200_000, help="largest input libFuzzer generates")
    ap.add_argument("--jobs", type=int, default=1, help="parallel fuzzing processes sharing the corpus")
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    ap.add_argument("libfuzzer_args", nargs="*", help="after --: passed to libFuzzer")
    args = ap.parse_args(argv)

    import atheris

    with atheris.instrument_imports(include=["mcf"]):
        from fuzz import targets

    if args.list:
        print("\n".join(sorted(targets.TARGETS)))
        return 0
    if args.target not in targets.TARGETS:
        ap.error(f"--target must be one of {', '.join(sorted(targets.TARGETS))}")
    fn = targets.TARGETS[args.target]

    corpus = HERE / "corpus" / args.target
    crashes = HERE / "crashes" / args.target
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    for data in targets.seeds(args.target) + [p.read_bytes() for p in targets.regressions(args.target)]:
        (corpus / f"seed-{hashlib.sha1(data).hexdigest()[:16]}").write_bytes(data)

    def one_input(data: bytes) -> None:
        fn(data)  # anything but MCFError (handled inside the target) propagates: atheris reports a crash

    lf = [sys.argv[0], f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_limit_mb}",
          f"-malloc_limit_mb={args.rss_limit_mb}", f"-max_len={args.max_len}",
          f"-artifact_prefix={crashes}{os.sep}", "-print_final_stats=1"]
    if args.seconds:
        lf.append(f"-max_total_time={args.seconds}")
    if args.runs:
        lf.append(f"-runs={args.runs}")
    if args.jobs > 1:
        lf += [f"-jobs={args.jobs}", f"-workers={args.jobs}"]
    lf += list(args.libfuzzer_args) + [str(corpus)]
    atheris.Setup(lf, one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
