"""A MegaContext writer run as a subprocess by tests/test_megacontext_crash.py: it appends a
deterministic token stream in small random chunks with gists for every complete span, commits after
each chunk and now and then rewrites a range of LOD1 gists in place, until killed or until it has made
``commits`` commits.  Usage: python _megacontext_writer.py TREE SEED COMMITS"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mcf.megacontext as mc  # noqa: E402
from _megacontext_ref import gist_rows, token_stream_at  # noqa: E402

STREAM_SEED = 5
D = 8


def main(path, seed, commits):
    rng = np.random.default_rng(seed)
    t = mc.open(path, "r+")
    print("ready " + " ".join(t.notes).replace("\n", " "), flush=True)
    k = t.block_size
    for _ in range(commits):
        c = int(rng.integers(1, 400))
        t.append_tokens(token_stream_at(t.num_tokens, c, STREAM_SEED), commit=False)
        for level, lower in ((1, t.num_tokens), (2, t.num_gists(1))):
            have, want = t.num_gists(level), lower // k
            if want > have:
                t.append_gists(level, gist_rows(level, have, want, D), checkpoint="v1", commit=False)
        t.commit()
        n1 = t.num_gists(1)
        if n1 > 20 and rng.random() < 0.05:
            a = int(rng.integers(0, n1 - 10))
            b = a + int(rng.integers(1, 10))
            t.write_gists(1, a, gist_rows(1, a, b, D, version=2), checkpoint="v2")
    t.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
