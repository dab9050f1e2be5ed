"""Object-store clients (obstore) made the way the AWS, Google and Azure tools configure theirs, one per
bucket or host and reused by every file opened there (its connection pool with it).

S3 settings come from, first to last (what the AWS CLI and botocore do):

- credentials: ``storage_options`` (``aws_access_key_id``/``aws_secret_access_key``/``aws_session_token``),
  then the profile ``storage_options["profile"]`` names, then ``AWS_ACCESS_KEY_ID``/
  ``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, then the profile ``AWS_PROFILE`` names (or
  ``default``) in the shared files (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``; static keys
  only: for SSO or role profiles, export the credentials to the environment), then whatever the client
  finds itself (web identity, container and instance credentials).  A key, its secret and its token
  are taken together from one place: a session token in the environment never joins keys given
  explicitly.
- region and endpoint: ``storage_options``, then ``AWS_REGION``/``AWS_DEFAULT_REGION`` and
  ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, then the profile's ``region``/``endpoint_url``.  An
  ``http://`` endpoint (a local MinIO or SeaweedFS) is allowed as it is.

Option names are those of the AWS configuration files, with s3fs's spellings accepted too (``key``,
``secret``, ``token``, ``endpoint_url``, ``client_kwargs={"region_name": ...}``, ``anon``), so a
dictionary written for s3fs works here.  Any other key goes to obstore's store config as it is (e.g.
``virtual_hosted_style_request``, ``request_payer``); for ``gs://`` and ``az://`` every key does (obstore's
names, e.g. ``service_account_path``, ``account_name``; their clients read ``GOOGLE_*`` and ``AZURE_*``
variables themselves).  ``anon=True`` sends unsigned requests; ``client_options`` go to obstore's HTTP
client (proxies, certificates); ``headers`` are sent with every HTTP(S) request.
"""

from __future__ import annotations

import configparser
import contextlib
import contextvars
import os
import threading

from mcf._core.optional import require
from mcf.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["storage_options", "default_options", "object_store", "s3_settings", "fsspec_options"]

# canonical S3 option -> the other spellings accepted for it
_S3_ALIASES = {
    "aws_access_key_id": ("key", "access_key_id"),
    "aws_secret_access_key": ("secret", "secret_access_key"),
    "aws_session_token": ("token", "session_token"),
    "region": ("region_name",),
    "endpoint_url": ("endpoint",),
}
_CREDENTIALS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
# the keys mcf itself understands for every kind of store
_COMMON = ("anon", "client_options", "headers")

_defaults: contextvars.ContextVar = contextvars.ContextVar("mcf_remote_storage_options", default=())


@contextlib.contextmanager
def storage_options(options: dict, *, prefix: str = ""):
    """Use ``options`` for every URL starting with ``prefix`` opened inside the ``with`` block without
    options of its own: the way to configure readers that open URLs themselves (a sharded checkpoint's
    shards, a MegaContext tree's files, a Megatron prefix's ``.idx`` and ``.bin``).  Blocks nest; the
    innermost matching one wins."""
    if not isinstance(options, dict):
        raise ArgumentTypeError(f"storage_options must be a dict, got {type(options).__name__}")
    if not isinstance(prefix, str):
        raise ArgumentTypeError(f"prefix must be a str, got {type(prefix).__name__}")
    token = _defaults.set(_defaults.get() + ((prefix, dict(options)),))
    try:
        yield
    finally:
        _defaults.reset(token)


def default_options(url: str) -> dict:
    """The options of the innermost :func:`storage_options` block whose prefix ``url`` starts with."""
    for prefix, opts in reversed(_defaults.get()):
        if url.startswith(prefix):
            return dict(opts)
    return {}


# -- AWS configuration ---------------------------------------------------------------------------------
def _canonical_s3(opts: dict) -> dict:
    out = {}
    for k, v in opts.items():
        name = next((c for c, alts in _S3_ALIASES.items() if k == c or k in alts), k)
        if name in out and out[name] != v:
            raise InvalidArgumentError(f"storage_options gives {name!r} twice (as {k!r} and another spelling)")
        out[name] = v
    kw = out.pop("client_kwargs", None)   # s3fs: client_kwargs={"endpoint_url": ..., "region_name": ...}
    if kw is not None:
        if not isinstance(kw, dict):
            raise ArgumentTypeError(f"storage_options['client_kwargs'] must be a dict, got {type(kw).__name__}")
        for k, v in kw.items():
            name = {"endpoint_url": "endpoint_url", "region_name": "region"}.get(k)
            if name is None:
                raise InvalidArgumentError(f"storage_options['client_kwargs'] key {k!r} is not supported "
                                           "(only endpoint_url and region_name, as s3fs takes them)")
            out.setdefault(name, v)
    return out


def _profile(name: str, environ, *, required: bool) -> dict:
    """The static settings of profile ``name`` in the shared credentials and config files."""
    home = os.path.expanduser("~")
    files = [(environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"), name),
             (environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
              name if name == "default" else f"profile {name}")]
    out, found = {}, False
    for path, section in files:
        cp = configparser.RawConfigParser()
        try:
            cp.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"{path}: cannot read the AWS shared file: {exc}") from None
        if cp.has_section(section):
            found = True
            for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "region", "endpoint_url"):
                if cp.has_option(section, k) and k not in out:
                    out[k] = cp.get(section, k).strip()
    if required and not found:
        raise InvalidArgumentError(f"the AWS profile {name!r} is not in {files[0][0]} nor {files[1][0]}")
    return out


def _printable_settings(opts: dict) -> None:
    """Refuse a string setting with a control character (a newline in a region): it cannot go in a request
    header, and obstore's signer panics on it instead of failing."""
    for k, v in opts.items():
        if isinstance(v, str) and any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
            raise InvalidArgumentError(f"storage_options[{k!r}] holds a control character (a newline?); S3 "
                                       "settings go into request headers and must be printable")


def s3_settings(opts: dict, environ=None) -> dict:
    """The S3 settings for ``opts`` (canonical names), resolved in the order of the module docstring.
    ``"credentials_from"`` says where the keys came from: "options", "profile", "environment" or None
    (the client's own chain)."""
    environ = os.environ if environ is None else environ
    opts = _canonical_s3(opts)
    _printable_settings(opts)
    explicit_profile = opts.pop("profile", None)
    env = {"aws_access_key_id": environ.get("AWS_ACCESS_KEY_ID"),
           "aws_secret_access_key": environ.get("AWS_SECRET_ACCESS_KEY"),
           "aws_session_token": environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN"),
           "region": environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION"),
           "endpoint_url": environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")}
    env = {k: v for k, v in env.items() if v}
    prof = _profile(explicit_profile, environ, required=True) if explicit_profile else {}
    anon = bool(opts.pop("anon", False))
    if explicit_profile:
        cred_layers = [("options", opts), ("profile", prof), ("environment", env)]
        layers = [opts, env, prof]
    else:
        env_profile = environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE")
        prof = _profile(env_profile or "default", environ, required=bool(env_profile))
        cred_layers = [("options", opts), ("environment", env), ("profile", prof)]
        layers = [opts, env, prof]
    out = {k: v for k, v in opts.items() if k not in _CREDENTIALS and k not in ("region", "endpoint_url")}
    out["credentials_from"] = None
    out["anon"] = anon
    if not anon:
        for where, layer in cred_layers:
            if layer.get("aws_access_key_id") or layer.get("aws_secret_access_key"):
                if not (layer.get("aws_access_key_id") and layer.get("aws_secret_access_key")):
                    raise InvalidArgumentError(f"S3 credentials from the {where} need both an access key id and "
                                               "a secret access key")
                out.update({k: layer.get(k) for k in _CREDENTIALS})
                out["credentials_from"] = where
                break
    for k in ("region", "endpoint_url"):
        v = next((layer[k] for layer in layers if layer.get(k)), None)
        if v is not None:
            out[k] = v
    return out


def fsspec_options(kind: str, opts: dict) -> dict:
    """``opts`` in s3fs's spelling when fsspec reads an ``s3://`` URL (the benchmarks' "today's path", or
    no obstore installed); other kinds pass through."""
    if kind != "s3":
        return opts
    s = _canonical_s3(opts)
    names = {"aws_access_key_id": "key", "aws_secret_access_key": "secret", "aws_session_token": "token"}
    out = {names.get(k, k): v for k, v in s.items() if k not in ("region",)}
    if "region" in s:
        out.setdefault("client_kwargs", {})["region_name"] = s["region"]
    return out


# -- the stores ------------------------------------------------------------------------------------------
_stores: dict = {}
_stores_lock = threading.Lock()
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


def _frozen(obj):
    if isinstance(obj, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_frozen(v) for v in obj)
    return obj


def _seconds(t: float) -> str:
    return f"{max(0.001, float(t)):.3f}s"


def object_store(kind: str, root: str, opts: dict, *, timeout: float | None, deadline: float | None = None,
                 retries: int = 0):
    """The obstore store for ``root`` (``s3://bucket``, ``https://host``...) with ``opts``: made once per
    bucket/host, options and relevant environment, then reused.  ``timeout`` bounds a silence, ``deadline``
    a whole request (default an hour).  ``retries`` are obstore's own (0 for reads: mcf retries every part
    itself; the writers of :mod:`mcf.remote._upload` let obstore retry a part's request).  Raises
    InvalidArgumentError for options the store refuses."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith(_ENV_PREFIXES)))
    key = (kind, root, _frozen(opts), timeout, deadline, retries, env)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            try:
                store = _make_store(kind, root, dict(opts), timeout, deadline, retries)
            except BaseException as exc:  # noqa: BLE001 - obstore panics (BaseException) on some bad settings
                if isinstance(exc, (KeyboardInterrupt, SystemExit, InvalidArgumentError, ArgumentTypeError)):
                    raise
                raise InvalidArgumentError(f"{root}: cannot configure the object store: "
                                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
                    from None
            _stores[key] = store
        return store


def _make_store(kind, root, opts, timeout, deadline, retries=0):
    obstore_store = require("obstore.store", feature=f"reading {root.split(':', 1)[0]}:// URLs", extra="remote",
                            package="obstore")
    from obstore.exceptions import BaseError, UnknownConfigurationKeyError

    client = opts.pop("client_options", None) or {}
    if not isinstance(client, dict):
        raise ArgumentTypeError(f"storage_options['client_options'] must be a dict, got {type(client).__name__}")
    client = dict(client)
    headers = opts.pop("headers", None)
    if headers:
        if kind != "http":
            raise InvalidArgumentError(f"storage_options['headers'] apply to http(s):// URLs, not {root}")
        client["default_headers"] = {**client.get("default_headers", {}), **dict(headers)}
    if timeout is not None:
        # a silent connection fails after `timeout` seconds; a whole request may take long (a large part
        # over a slow link), so the client's overall timeout (30 s by default) is lifted to an hour
        client.setdefault("connect_timeout", _seconds(timeout))
        client.setdefault("read_timeout", _seconds(timeout))
    client.setdefault("timeout", _seconds(deadline) if deadline is not None else "3600s")
    # reads: mcf retries every part itself (mcf.remote._fetch): one count, one backoff
    retry = {"max_retries": int(retries)}
    try:
        if kind == "s3":
            return _s3_store(obstore_store, root, opts, client, retry)
        anon = bool(opts.pop("anon", False))
        if kind == "http":
            if opts:
                raise InvalidArgumentError(f"storage_options for {root} take only {list(_COMMON)}, got "
                                           f"{sorted(opts)}")
            if root.startswith("http://"):
                client.setdefault("allow_http", True)
            return obstore_store.HTTPStore.from_url(root, client_options=client, retry_config=retry)
        if anon:
            opts["skip_signature"] = True
        return obstore_store.from_url(root, config=opts or None, client_options=client, retry_config=retry)
    except UnknownConfigurationKeyError as exc:
        raise InvalidArgumentError(f"{root}: unknown storage option: {str(exc).splitlines()[0]}") from None
    except BaseError as exc:
        raise InvalidArgumentError(f"{root}: cannot configure the object store: {str(exc).splitlines()[0]}") \
            from None


def _s3_store(obstore_store, root, opts, client, retry):
    s = s3_settings(opts)
    src = s.pop("credentials_from")
    anon = s.pop("anon")
    config = {k: v for k, v in s.items() if k not in _CREDENTIALS and k not in ("region", "endpoint_url")}
    if s.get("region"):
        config["region"] = s["region"]
    endpoint = s.get("endpoint_url")
    if endpoint:
        # both names: the client reads AWS_ENDPOINT_URL_S3 itself and would let it beat "endpoint"
        config["endpoint"] = config["aws_endpoint_url_s3"] = endpoint
        if endpoint.startswith("http://"):
            client.setdefault("allow_http", True)
    provider = None
    if anon:
        config["skip_signature"] = True
    elif src in ("options", "profile"):
        creds = {"access_key_id": s["aws_access_key_id"], "secret_access_key": s["aws_secret_access_key"],
                 "token": s.get("aws_session_token") or None, "expires_at": None}

        def provider():
            return creds
    bucket = root.split("://", 1)[1]
    return obstore_store.S3Store(bucket, config=config, client_options=client, retry_config=retry,
                                 credential_provider=provider)
