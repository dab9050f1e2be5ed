"""However the bucket's directory is spelt on the command line, no message the server sends names it:
``--root a/../b`` put the path into every 404, because only the absolute and the
resolved spellings were scrubbed, while the bucket's messages use the spelling it was given."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _bucket_server import request, serve

from mcf.bucket._names import root_scrubber

pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")

UPLOAD = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


def npz_body() -> bytes:
    import io

    k = np.arange(2 * 2 * 6 * 4, dtype=np.float32).reshape(2, 2, 6, 4)
    bio = io.BytesIO()
    np.savez(bio, k=k, v=-k)
    return bio.getvalue()


SPELLINGS = {
    "relative with ..": lambda d: "zqleft/../zqbucket",
    "absolute with ..": lambda d: f"{d}/zqleft/../zqbucket",
    "trailing slashes": lambda d: "./zqbucket//",
    "through a link": lambda d: "zqlink",
    "absolute through a link": lambda d: f"{d}/zqlink/",
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_no_spelling_of_the_root_reaches_a_client(tmp_path, spelling):
    (tmp_path / "zqleft").mkdir()
    (tmp_path / "zqbucket").mkdir()
    (tmp_path / "zqlink").symlink_to("zqbucket")
    root = SPELLINGS[spelling](tmp_path)
    seen = []
    with serve(root, None, cwd=tmp_path) as (base, _):
        st, out, _ = request(base, "POST", "/mcrp/v1/contexts?model_id=m&content=x", npz_body(), UPLOAD)
        assert st == 201, out
        cid = out["context_id"]
        st, out, _ = request(base, "GET", "/mcrp/v1/contexts/ctx_" + "0" * 32)  # the audit's 404
        assert st == 404
        seen.append(out["error"])
        (tmp_path / "zqbucket" / "contexts" / cid / "metadata.json").write_text("{not json")
        for method, path in (("GET", f"/mcrp/v1/contexts/{cid}"), ("GET", f"/mcrp/v1/contexts/{cid}/kv"),
                             ("POST", f"/mcrp/v1/contexts/{cid}/promote"),
                             ("DELETE", "/mcrp/v1/contexts/ctx_" + "1" * 32)):
            st, out, _ = request(base, method, path, b"{}" if method == "POST" else None, JSON)
            assert st in (404, 422), (path, st, out)
            seen.append(out["error"])
        st, out, _ = request(base, "POST", "/mcrp/v1/registry/rebuild", b"{}", JSON)
        assert st == 200 and out["skipped"], out
        seen.append(json.dumps(out))
    text = "\n".join(seen)
    print(text)  # the report's figures (-s)
    assert "zq" not in text and tmp_path.name not in text, text
    assert text.count("<bucket>") >= 4


def test_the_scrubber_replaces_paths_not_words(tmp_path):
    """A relative spelling is replaced where it is a path (whole components), not inside other words."""
    scrub = root_scrubber("b")
    assert scrub("no context 'ctx_1' in b") == "no context 'ctx_1' in <bucket>"
    assert scrub("b/contexts/ctx_1/metadata.json: malformed") == "<bucket>/contexts/ctx_1/metadata.json: malformed"
    assert scrub("a bad blob: abc/b, b.json, /x/b/y, b-c") == "a bad blob: abc/b, b.json, /x/b/y, b-c"
    scrub = root_scrubber(".")
    assert scrub("contexts/x. in .") == "contexts/x. in ."  # nothing to hide in "."
    absolute = os.path.abspath("data/../mcb")
    scrub = root_scrubber("data/../mcb")
    assert scrub(f"({absolute}/contexts)") == "(<bucket>/contexts)"
    assert scrub("'data/../mcb/registry.json'") == "'<bucket>/registry.json'"
