"""Schemathesis against the bucket server's own OpenAPI document, over HTTP to the server started as a
real process on loopback (``mcf bucket serve``).

Why: the hand-written tests in test_bucket_server.py check the cases someone thought of; schemathesis
generates requests from the document (valid and invalid parameters, bodies, ids, missing or wrong
tokens) and checks every response against it: no 5xx, every status code and content type documented,
every JSON body valid against its schema, invalid input rejected, auth enforced.  The bucket is seeded
with a context so that the id-taking endpoints also see a real id (the document's ``example``).
"""

from __future__ import annotations

import copy
import json
import re
import urllib.error
import urllib.request
import zlib

import numpy as np
import pytest
from _bucket_server import serve

pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")
schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a test extra")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error, positive_data_acceptance  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.core.parameters import ParameterLocation  # noqa: E402

from mcf.bucket import Bucket  # noqa: E402
from mcf.apps.bucket_server import OPENAPI  # noqa: E402

TOKEN = "schema-token-of-at-least-32-bytes-0123456789"

# schemathesis' checks (ignored_auth and others) send extra requests on sessions of their own and leave
# those sockets to the garbage collector; that ResourceWarning is the tool's, not the server's
pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module", autouse=True)
def _collect_tool_sockets():
    yield
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucket-schema")
    rng = np.random.default_rng(3)
    b = Bucket(root)
    layers = [(rng.standard_normal((2, 8, 4)).astype(np.float32),) * 2 for _ in range(2)]
    seeded = b.ingest("seed-model", layers, token_ids=list(range(8)), name="seeded", compression="lz4")
    b.set_tier_preference(seeded["context_id"], "warm")  # applied by the server at start-up
    with serve(root, TOKEN) as (base, _):
        req = urllib.request.Request(base + "/mcrp/v1/models/seed-model/contexts",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert [c["tier"] for c in json.loads(r.read())["contexts"]] == ["warm"]
        yield base, seeded["context_id"]


@pytest.fixture(scope="module")
def api_schema(live_server):
    base, _ = live_server
    # the document as the live server serves it (fetched here rather than by from_url, whose download
    # leaves its socket to the garbage collector: a ResourceWarning, an error under filterwarnings)
    with urllib.request.urlopen(base + "/mcrp/v1/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    return schemathesis.openapi.from_dict(doc)


# One test per operation of the document, each running hypothesis over schemathesis' positive and negative
# cases.  (Not schemathesis' pytest plugin: its from_fixture integration reads pytest internals that
# pytest 9.2 removed, so it breaks with every pytest release; the strategies are its public API.)
# The event stream is left out: its response ends only when the client leaves (or a valid request never
# returns); tests/test_bucket_events.py drives it over loopback, invalid ids and the auth included.
OPERATIONS = [r.ok().label for r in schemathesis.openapi.from_dict(OPENAPI).get_all_operations()
              if r.ok().path != "/mcrp/v1/events"]


def _operation(schema, label):
    for r in schema.get_all_operations():
        op = r.ok()
        if op.label == label:
            return op
    raise AssertionError(f"the served document has no operation {label} (the module's OPENAPI has it)")


@schemathesis.check
def no_server_error_but_501(ctx, response, case):
    if response.status_code >= 500 and response.status_code != 501:
        raise AssertionError(f"server error {response.status_code}: {response.text[:200]}")


@pytest.fixture(scope="module")
def http_session():
    """One keep-alive session for every generated call, closed at the end (schemathesis would open
    one per call and leave its socket to the garbage collector: a ResourceWarning, an error here)."""
    import requests

    with requests.Session() as s:
        yield s


@pytest.mark.parametrize("label", OPERATIONS)
def test_api_conforms_to_its_openapi_document(label, api_schema, live_server, http_session):
    op = _operation(api_schema, label)
    cases = st.one_of(op.as_strategy(generation_mode=GenerationMode.POSITIVE),
                      op.as_strategy(generation_mode=GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case):
        _check_case(case, live_server, http_session)

    run()


def _check_case(case, live_server, http_session):
    base, seeded = live_server
    excluded, additional = [], []
    ingest = case.operation.method.upper() == "POST" and case.operation.path.endswith("/contexts")
    if ingest:
        # the ingest body is an .npz archive, which a JSON schema cannot describe: bytes generated as
        # "valid" are not a valid archive and are rightly refused with 422
        excluded.append(positive_data_acceptance)
    if "/page/{key}" in case.operation.path:
        # a page's name is a key as page_name writes it: its pattern cannot say that the %XX escapes must
        # decode to UTF-8 that page_name escapes the same way, so a name the pattern admits may still be
        # no key's name, rightly refused with 400
        excluded.append(positive_data_acceptance)
    if case.operation.path.endswith("/query") or ingest:
        # 501 is the documented answer without a model backend (the engine contains no language model):
        # to a query, and to an ingest of the content as JSON; any other 5xx is still a failure
        excluded.append(not_a_server_error)
        additional.append(no_server_error_but_501)
    cid = (case.path_parameters or {}).get("id")
    if (case.operation.path.startswith("/mcrp/v1/contexts/") and case.operation.method.upper() != "DELETE"
            and isinstance(cid, str) and re.fullmatch(r"ctx_[0-9a-f]{32}", cid)
            and zlib.crc32(cid.encode()) % 2 == 0):
        case.path_parameters["id"] = seeded  # half of the well-formed ids name a context that exists
    # the token goes in unless the case is negative in its headers: one such mutation is leaving out the
    # Authorization header the document requires, which adding it back would undo (the server would then
    # rightly answer 200 to what schemathesis counts as an invalid request)
    auth = {} if case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER) else {
        "Authorization": f"Bearer {TOKEN}"}
    case.call_and_validate(base_url=base, session=http_session, headers=auth, excluded_checks=excluded,
                         additional_checks=additional)


def test_openapi_document_is_served_without_token(live_server):
    """The document itself is public (a client needs it to authenticate); everything else is not."""
    base, cid = live_server
    with urllib.request.urlopen(base + "/mcrp/v1/openapi.json", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(base + f"/mcrp/v1/contexts/{cid}", timeout=10)
    assert exc.value.code == 401


def test_harness_reports_a_mismatch(live_server, http_session):
    """The harness can fail: against a copy of the document that misdescribes GET /registry, the same
    call is reported as a schema violation."""
    base, _ = live_server
    doc = copy.deepcopy(OPENAPI)
    doc["paths"]["/mcrp/v1/registry"]["get"]["responses"]["200"] = {
        "description": "wrong on purpose", "content": {"application/json": {"schema": {"type": "integer"}}}}
    op = schemathesis.openapi.from_dict(doc)["/mcrp/v1/registry"]["GET"]
    with pytest.raises(FailureGroup, match="does not conform|Response violates schema"):
        op.Case().call_and_validate(base_url=base, session=http_session,
                                    headers={"Authorization": f"Bearer {TOKEN}"})


def test_unknown_query_parameter_and_wrong_method(live_server):
    base, cid = live_server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    req = urllib.request.Request(base + "/mcrp/v1/models/m/contexts?force_scna=true", headers=auth)
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 400 and "force_scna" in exc.value.read().decode()
    req = urllib.request.Request(base + "/mcrp/v1/contexts", method="PUT", headers=auth)
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 405 and set(exc.value.headers["allow"].replace(" ", "").split(",")) >= {"GET", "POST"}
