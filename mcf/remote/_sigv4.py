"""Pre-signed S3 URLs (AWS Signature Version 4, query-string authentication), made by mcf itself for keys it
resolved itself (options, environment, profile) and for anonymous reads, so that S3 needs neither obstore
nor s3fs: mcf's HTTP client fetches them on every Python.

A pre-signed URL carries the signature, the key id and the session token in its query string and signs only
the ``host`` header, so the request holds no credential in a header a redirect could forward, and extra
unsigned headers (``Range``, ``If-Match``) may be sent with it.  The layout is path style
(``ENDPOINT/BUCKET/KEY``), what S3-compatible servers (MinIO, SeaweedFS, Ceph, R2) and AWS all take;
``https://s3.REGION.amazonaws.com`` is the endpoint when none is configured.  Reference: AWS's "Authenticating
Requests: Using Query Parameters (AWS Signature Version 4)".
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from urllib.parse import quote, urlsplit

from mcf.errors import InvalidArgumentError
from mcf.remote._urls import redact

__all__ = ["presign", "object_url"]

_UNRESERVED = "-_.~"


def _uri_encode(s: str, *, slash: bool) -> str:
    """AWS's UriEncode: every byte but the unreserved ones percent-encoded (``/`` kept in a path)."""
    return quote(s, safe=_UNRESERVED + ("/" if slash else ""))


def object_url(endpoint: str | None, region: str, bucket: str, key: str) -> str:
    """The path-style URL of ``bucket/key`` (the key percent-encoded as S3 expects it)."""
    base = (endpoint or f"https://s3.{region}.amazonaws.com").rstrip("/")
    return f"{base}/{_uri_encode(bucket, slash=False)}/{_uri_encode(key, slash=True)}"


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def presign(method: str, url: str, *, access_key: str, secret_key: str, token: str | None, region: str,
            expires: int, now: datetime.datetime | None = None) -> str:
    """``url`` (from :func:`object_url`) with the query that authorizes ``method`` on it for ``expires``
    seconds, signed with the keys."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    scope = f"{day}/{region}/s3/aws4_request"
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port and not ((parts.scheme == "https" and parts.port == 443) or (parts.scheme == "http"
                                                                                and parts.port == 80)):
        host = f"{host}:{parts.port}"
    query = {"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": f"{access_key}/{scope}",
             "X-Amz-Date": amz_date, "X-Amz-Expires": str(int(expires)), "X-Amz-SignedHeaders": "host"}
    if token:
        query["X-Amz-Security-Token"] = token
    canonical_query = "&".join(f"{_uri_encode(k, slash=False)}={_uri_encode(v, slash=False)}"
                               for k, v in sorted(query.items()))
    canonical = "\n".join([method, parts.path or "/", canonical_query, f"host:{host}\n", "host", "UNSIGNED-PAYLOAD"])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + secret_key).encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"{parts.scheme}://{parts.netloc}{parts.path}?{canonical_query}&X-Amz-Signature={signature}"


#: how long a pre-signed URL is valid; one is reused for half of it, then signed again
SIGNED_URL_LIFETIME = 900
# what s3_settings may hold besides what a signer needs, and still be signed here
_SIGNABLE = {"credentials_from", "anon", "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "region",
             "endpoint_url", "client_options"}


def s3_signer(target, opts: dict):
    """``sign(method) -> URL`` for an ``s3://`` object whose keys mcf resolves itself (options, environment,
    profile) or which is read anonymously; None where only obstore can authenticate (credentials from the
    role chain: web identity, an instance or container role) or the options ask for what only obstore does
    (``virtual_hosted_style_request``, ``request_payer``...)."""
    import threading
    import time

    from mcf.remote._stores import s3_settings

    if target.kind != "s3":
        return None
    s = s3_settings(opts)
    if set(s) - _SIGNABLE or (not s["anon"] and s["credentials_from"] is None):
        return None
    if any(seg in (".", "..") for seg in target.key.split("/")):
        # servers and proxies resolve dot segments of a URL path: the object read would not be the one named
        raise InvalidArgumentError(f"{redact(target.url)}: an S3 key with '.' or '..' segments ({target.key!r}) "
                                   "cannot be read over HTTP as written")
    region = s.get("region") or "us-east-1"
    bucket = target.root.split("://", 1)[1]
    url = object_url(s.get("endpoint_url"), region, bucket, target.key)
    if s["anon"]:
        return lambda method: url
    keys = (s["aws_access_key_id"], s["aws_secret_access_key"], s.get("aws_session_token") or None)
    cache: dict = {}
    lock = threading.Lock()

    def sign(method: str) -> str:
        with lock:
            signed, until = cache.get(method, (None, 0.0))
            if signed is None or time.monotonic() >= until:
                signed = presign(method, url, access_key=keys[0], secret_key=keys[1], token=keys[2], region=region,
                                 expires=SIGNED_URL_LIFETIME)
                cache[method] = (signed, time.monotonic() + SIGNED_URL_LIFETIME / 2)
            return signed

    return sign
