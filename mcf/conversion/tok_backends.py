"""Tokenizer backends: one tokenizer, several engines that encode with it, the same ids from each.

The Hugging Face ``tokenizers`` library is the reference: every tokenizer is first loaded as a
``tokenizers.Tokenizer`` (:func:`load_source`), and its ids are the ones a dataset must hold.  The
other backends encode the same tokenizer faster:

- ``fastokens`` (PyPI ``fastokens``), a Rust reimplementation that reads the same ``tokenizer.json``
  (BPE with byte-level or regex pre-tokenizers; it refuses what it does not implement, such as BERT's
  normalizer and WordPiece) and returns a whole batch as one flat ``uint32`` buffer plus offsets;
- ``tiktoken`` (PyPI ``tiktoken``), for tiktoken-format vocabularies only: a ``tiktoken.Encoding``, a
  ``tiktoken:NAME`` encoding that tiktoken can load (its cache; this needs no network only when cached),
  or a ``.tiktoken`` ranks file with its split pattern named (``tiktoken_pattern=``).  The reference
  for such a vocabulary is the ``tokenizer.json`` built from it the way transformers' ``TikTokenConverter``
  builds one (:meth:`TiktokenVocab.to_hf`): byte-level BPE whose merges follow the ranks, the same split
  regex, merges skipped for a piece that is a token (tiktoken's rule), special tokens at their ids.

Every backend has the same small interface (:class:`Backend`): ``encode(texts, add_special_tokens)``
returns ``(ids, offsets)``, the ids of all texts as one flat ``uint32`` array and ``len(texts) + 1``
int64 offsets, so that no per-token Python object is made (HF tokenizers' own ``Encoding.ids`` are
lists, converted in compiled code).

``auto`` (:func:`choose_backend`) takes the first of :data:`AUTO_ORDER` that is installed, loads the
tokenizer and gives exactly HF tokenizers' ids (or refuses the same texts) on :data:`PROBE_TEXTS`:
whitespace runs, digits, punctuation, contractions, many scripts, emoji, combining marks, lone
surrogates (as ``json.loads`` makes them from ``\\ud800`` escapes), very long words, and every added
and special token of the tokenizer next to text.  Otherwise it uses HF tokenizers and says why, once
per tokenizer and reason, through the ``mcf.tokenize`` logger (and in the ``note`` it returns, which
``mcf megatron tokenize`` prints).  Naming a backend (``hf``, ``fastokens``, ``tiktoken``) runs the
same probe and refuses a backend that fails it.
"""

from __future__ import annotations

import abc
import base64
import binascii
import hashlib
import json
import logging
import os
import re
import threading

import numpy as np

from mcf._core.optional import require
from mcf.errors import FormatError, InvalidArgumentError, MCFError

__all__ = ["BACKENDS", "AUTO_ORDER", "PROBE_TEXTS", "Backend", "TiktokenVocab", "TokenizerSource", "load_source",
           "make_backend", "choose_backend", "probe_mismatch", "read_tiktoken_file"]

#: the names ``backend=`` / ``--tokenizer-backend`` take
BACKENDS = ("auto", "hf", "fastokens", "tiktoken")
#: the order ``auto`` tries, fastest first (bench/test_bench_tokenize.py); HF tokenizers is the fallback
AUTO_ORDER = ("fastokens", "tiktoken")

LOG = logging.getLogger("mcf.tokenize")

_ADDED_PROBED = 64   # added tokens put into the probe (a vocabulary may add thousands)


def _probe_texts() -> tuple:
    long_word = "Pneumonoultramicroscopicsilicovolcanoconiosis" * 40
    return (
        "", " ", "  ", "\t", "\n", "\r\n", "a", " a", "a ", "  leading and trailing  ",
        "tabs\tand\t\tmore\t\t\ttabs", "line\nbreaks\n\n\nand\r\nwindows\r\n\r\nones\n",
        "runs:" + " " * 17 + "x" + "\n" * 9 + "y" + "\t \n " * 5,
        "no-break\u00a0space, em\u2003space, ideographic\u3000space, thin\u2009space, zero\u200bwidth",
        "0 1 12 123 1234 12345 123456789012345678901234567890 3.14159 -2.5e-10 0x1F 1,000,000 1_000",
        "Arabic-Indic ١٢٣٤ Devanagari १२३ fullwidth １２３ superscript ²³ fraction ½ roman Ⅻ",
        "Hello, world! What?! ... -- --- (a) [b] {c} <d> \"q\" 'q' `q` ~ @ # $ % ^ & * _ + = | \\ / ;: ,.",
        "a==b != c<=d >>= e->f => g::h ?? i?.j ... /* c */ // c # c <!-- c --> ''' \"\"\"",
        "I'm you're he's she'd we'll they've it's can't won't shouldn't y'all'd've I'M YOU'RE WE'LL",
        "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D",
        "English, Français, Español, Deutsch: Grüße, Straße, façade, naïve, Ångström, ÆØÅ æøå",
        "Русский текст, Ελληνικά κείμενα, Українська мова, Български",
        "中文文本，日本語のテキスト、한국어 텍스트입니다。",
        "العربية النص עברית טקסט فارسی متن اردو",
        "हिन्दी पाठ বাংলা লেখা தமிழ் உரை ગુજરાતી ਪੰਜਾਬੀ తెలుగు ಕನ್ನಡ മലയാളം",
        "ภาษาไทย ລາວ ខ្មែរ မြန်မာ ქართული Հայերեն አማርኛ ᏣᎳᎩ",
        "mixed中文and English with 数字123 and العربية inline",
        "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ❤️ ✌🏿 🧑🏻‍💻 #️⃣ 🫠",
        "combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 Z\u0337\u0322a\u0336l\u0337g\u0334o\u0335 "
        "\u0301leading mark, Hangul jamo \u1100\u1161\u11a8",
        "precomposed é vs decomposed e\u0301; Å vs A\u030a; ﬁ ligature; Ⅸ; ㍿; ｶﾀｶﾅ",
        "control \x00 \x01 \x07 \x1b[31m \x7f \x85 \u2028 \u2029 \ufeff \ufffd \uffff",
        "astral 𝐀𝐁𝐂 𝔘𝔫𝔦 𠀀𠀁 𓀀 \U0010ffff",
        "lone surrogate \ud800 in text", "\udfff", "pair as surrogates \ud83d\ude00 made by a JSON parser",
        long_word, "x" * 20000, " ".join([long_word] * 3), "🙂" * 3000, "١" * 5000, "\u0301" * 2000,
        "def f(x):\n    return {'a': [1, 2, 3], \"b\": (x ** 2) // 3}\n\n\nclass C:\n\tpass\n",
        "https://example.com/path?q=1&r=%20#frag user@example.com C:\\Windows\\path",
    )


#: texts on which a backend must give HF tokenizers' ids (or refuse what HF refuses); the tokenizer's
#: own added and special tokens are added to these by :func:`probe_texts`
PROBE_TEXTS = _probe_texts()


# -- tiktoken-format vocabularies -----------------------------------------------------------------------
def _bytes_to_unicode() -> dict:
    """GPT-2's byte-to-character map, the alphabet of byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ [0-9]+\r?$")


# ``X{n,m}+`` is possessive in tiktoken's regex engine (fancy-regex) and in PCRE2, but in Oniguruma (HF
# tokenizers' engine, Ruby syntax) it means ``(X{n,m})+``: cl100k_base's ``\p{N}{1,3}+`` would take every
# digit at once.  The atomic group ``(?>X{n,m})`` means the same in all three.
_POSSESSIVE_INTERVAL = re.compile(
    r"(\\p\{\w+\}|\\P\{\w+\}|\[(?:\\.|[^\]\\])*\]|\\.|[^\\()\[\]{}|])(\{\d+(?:,\d*)?\})\+")


def onig_pattern(pattern: str) -> str:
    """``pattern`` (tiktoken's regex syntax) for Oniguruma: possessive intervals become atomic groups."""
    return _POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", pattern)


def is_tiktoken_file(path: str) -> bool:
    """Whether the regular file ``path`` starts like a tiktoken ranks file (``base64 rank`` lines)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    lines = [x for x in head.split(b"\n")[:-1] if x.strip()] or ([head] if head and b"\n" not in head else [])
    return bool(lines) and all(_TIKTOKEN_LINE.match(x) for x in lines[:8])


def read_tiktoken_file(path: str) -> dict:
    """The ranks of a tiktoken file (``base64(token) rank`` a line), read locally; a malformed line is a
    :class:`mcf.FormatError` naming the file and the line."""
    from mcf._core.fs import MAX_TOKENIZER_BYTES, read_regular

    raw = read_regular(path, limit=MAX_TOKENIZER_BYTES, what="tiktoken file")
    ranks: dict = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise FormatError("not a tiktoken ranks line", path=path, field=f"line {n}",
                              expected="base64 token, a space, an integer rank") from None
    return ranks


class TiktokenVocab:
    """A tiktoken-format vocabulary: ``ranks`` (token bytes to id), the split ``pattern`` and the
    ``special_tokens`` (text to id)."""

    def __init__(self, name: str, ranks: dict, pattern: str, *, special_tokens: dict | None = None):
        self.name = str(name)
        self.ranks = dict(ranks)
        self.pattern = str(pattern)
        self.special_tokens = {str(k): int(v) for k, v in (special_tokens or {}).items()}
        byte_tokens = {bytes([b]) for b in range(256)}
        if not byte_tokens <= self.ranks.keys():
            raise InvalidArgumentError(f"{self.name}: a tiktoken vocabulary must hold all 256 single bytes; "
                                       f"{len(byte_tokens - self.ranks.keys())} are missing")

    @classmethod
    def from_encoding(cls, enc) -> "TiktokenVocab":
        """From a ``tiktoken.Encoding`` (its ranks, pattern and special tokens)."""
        return cls(enc.name, enc._mergeable_ranks, enc._pat_str, special_tokens=enc._special_tokens)

    def encoding(self):
        """A ``tiktoken.Encoding`` of this vocabulary."""
        tiktoken = require("tiktoken", feature="the tiktoken tokenizer backend", extra="tokenize")
        return tiktoken.Encoding(self.name, pat_str=self.pattern, mergeable_ranks=self.ranks,
                                 special_tokens=self.special_tokens)

    def to_hf(self):
        """The equivalent ``tokenizers.Tokenizer`` (the reference ids), built as transformers'
        ``TikTokenConverter`` builds it: every token's byte-level spelling keeps its rank as id, each way
        to split a token into two tokens is a merge, merges ordered by the rank of what they make, a
        piece that is a whole token not merged further (``ignore_merges``), the pattern as an isolating
        split, and the special tokens added at their own ids."""
        tokenizers = require("tokenizers", feature="tokenizing text", extra="tokenize")
        b2u = _bytes_to_unicode()

        def spell(b: bytes) -> str:
            return "".join(b2u[x] for x in b)

        ranks = self.ranks
        vocab = {spell(t): r for t, r in ranks.items()}
        merges = []
        for tok, rank in ranks.items():
            if len(tok) < 2:
                continue
            local = [(ranks[tok[:i]], ranks[tok[i:]], tok[:i], tok[i:]) for i in range(1, len(tok))
                     if tok[:i] in ranks and tok[i:] in ranks]
            local.sort()
            merges.extend((rank, a, b) for _, _, a, b in local)
        merges.sort(key=lambda m: m[0])
        model = tokenizers.models.BPE(vocab, [(spell(a), spell(b)) for _, a, b in merges], fuse_unk=False)
        if hasattr(model, "ignore_merges"):
            model.ignore_merges = True
        tok = tokenizers.Tokenizer(model)
        pre = tokenizers.pre_tokenizers
        split = pre.Split(tokenizers.Regex(onig_pattern(self.pattern)), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = tokenizers.decoders.ByteLevel()
        if self.special_tokens:  # at their own ids: through the JSON, which carries ids
            spec = json.loads(tok.to_str())
            spec["added_tokens"] = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                                     "normalized": False, "special": True}
                                    for s, i in sorted(self.special_tokens.items(), key=lambda x: x[1])]
            tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
        return tok

    def __reduce__(self):
        return (_tiktoken_vocab, (self.name, self.ranks, self.pattern, self.special_tokens))


def _tiktoken_vocab(name, ranks, pattern, special_tokens):
    return TiktokenVocab(name, ranks, pattern, special_tokens=special_tokens)


def _named_encoding(name: str):
    tiktoken = require("tiktoken", feature="tiktoken encodings", extra="tokenize")
    try:
        return tiktoken.get_encoding(name)
    except ValueError as exc:  # an unknown name
        raise InvalidArgumentError(f"tiktoken:{name}: {exc}") from None
    except Exception as exc:  # no network and no cached copy (requests' errors, OSError...)
        from mcf.remote import redact

        raise InvalidArgumentError(
            f"tiktoken:{name}: tiktoken could not load it ({type(exc).__name__}: {redact(str(exc))}); it downloads "
            "an encoding once into TIKTOKEN_CACHE_DIR: pass a local .tiktoken file with --tiktoken-pattern instead"
        ) from None


class TokenizerSource:
    """A loaded tokenizer: ``hf`` (the reference ``tokenizers.Tokenizer``), ``tiktoken`` (a
    :class:`TiktokenVocab` when the tokenizer is one, else None) and ``label`` (for messages).
    ``json``, if given, is :attr:`json` (then ``hf`` may be None: a backend other than ``hf`` is built
    from the JSON alone, as a worker process builds the backend its parent chose)."""

    def __init__(self, hf, tiktoken: TiktokenVocab | None, label: str, *, json: str | None = None):
        self.hf = hf
        self.tiktoken = tiktoken
        self.label = label
        self._json: str | None = json

    @property
    def json(self) -> str:
        """The reference tokenizer as ``tokenizer.json`` text."""
        if self._json is None:
            self._json = self.hf.to_str()
        return self._json

    @property
    def digest(self) -> str:
        """sha256 of :attr:`json`: what the tokenizer is, for plans and caches."""
        return hashlib.sha256(self.json.encode()).hexdigest()


def load_source(source, *, tiktoken_pattern: str | None = None) -> TokenizerSource:
    """A :class:`TokenizerSource` from anything :func:`mcf.conversion.tokenizer.load_tokenizer` takes, or
    from a tiktoken-format tokenizer: a ``tiktoken.Encoding``, a :class:`TiktokenVocab`, ``"tiktoken:NAME"``
    (an encoding tiktoken can load), or a ``.tiktoken`` ranks file (recognized by its lines) with
    ``tiktoken_pattern``: the split regex, or ``tiktoken:NAME`` / ``NAME`` of an encoding whose pattern
    and special tokens it uses."""
    from mcf.conversion.tokenizer import load_tokenizer

    if isinstance(source, TokenizerSource):
        return source
    vocab = None
    if isinstance(source, TiktokenVocab):
        vocab = source
    elif type(source).__module__.startswith("tiktoken") and hasattr(source, "_mergeable_ranks"):
        vocab = TiktokenVocab.from_encoding(source)
    elif isinstance(source, str) and source.startswith("tiktoken:"):
        vocab = TiktokenVocab.from_encoding(_named_encoding(source[len("tiktoken:"):]))
    elif isinstance(source, (str, os.PathLike)) and os.path.isfile(os.fspath(source)) \
            and is_tiktoken_file(os.fspath(source)):
        path = os.fspath(source)
        if not tiktoken_pattern:
            raise InvalidArgumentError(f"{path}: a tiktoken ranks file does not hold its split pattern: name it with "
                                       "tiktoken_pattern= (--tiktoken-pattern): a regex, or the name of a tiktoken "
                                       "encoding (cl100k_base...) whose pattern and special tokens to use")
        ranks = read_tiktoken_file(path)
        pattern, special = tiktoken_pattern, {}
        name = tiktoken_pattern[len("tiktoken:"):] if tiktoken_pattern.startswith("tiktoken:") else tiktoken_pattern
        if re.fullmatch(r"[A-Za-z0-9_]+", name):
            enc = _named_encoding(name)
            pattern, special = enc._pat_str, enc._special_tokens
        vocab = TiktokenVocab(os.path.basename(path), ranks, pattern, special_tokens=special)
    elif tiktoken_pattern is not None:
        raise InvalidArgumentError("tiktoken_pattern (--tiktoken-pattern) applies to a .tiktoken ranks file")
    if vocab is not None:
        try:
            hf = vocab.to_hf()
        except MCFError:
            raise
        except Exception as exc:  # tokenizers refuses the pattern (its own exception type)
            raise InvalidArgumentError(f"{vocab.name}: the tiktoken vocabulary does not convert to a tokenizer.json: "
                                       f"{exc}") from None
        return TokenizerSource(hf, vocab, f"tiktoken vocabulary {vocab.name}")
    label = getattr(source, "path", None) if not isinstance(source, (str, os.PathLike)) else os.fspath(source)
    return TokenizerSource(load_tokenizer(source), None, str(label) if label else "the tokenizer")


# -- backends -------------------------------------------------------------------------------------------
class Backend(abc.ABC):
    """Encodes batches of texts with one tokenizer: ``name`` and :meth:`encode`."""

    name = "?"

    @abc.abstractmethod
    def encode(self, texts: list, add_special_tokens: bool):
        """``(ids, offsets)``: the ids of all ``texts`` as one flat uint32 array; text k's are
        ``ids[offsets[k]:offsets[k+1]]`` (``offsets``: int64, ``len(texts) + 1``)."""


def _lists_to_flat(lists: list):
    from mcf.megatron import _megatron

    flat, lens = _megatron.flat_tokens(lists, np.dtype(np.uint32))
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return flat, offsets


class HFBackend(Backend):
    """HF tokenizers' ``encode_batch_fast`` (``encode_batch`` before 0.20): the reference."""

    name = "hf"

    def __init__(self, tok):
        self.tok = tok
        self._encode = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def encode(self, texts, add_special_tokens: bool):
        if not texts:
            return np.empty(0, np.uint32), np.zeros(1, np.int64)
        return _lists_to_flat([e.ids for e in self._encode(texts, add_special_tokens=add_special_tokens)])


class FastokensBackend(Backend):
    """fastokens' ``encode_batch_flat``: one flat uint32 buffer and uint64 offsets per batch."""

    name = "fastokens"

    def __init__(self, source: TokenizerSource):
        fastokens = require("fastokens", feature="the fastokens tokenizer backend", extra="tokenize")
        try:
            self.tok = fastokens.Tokenizer.from_json_str(source.json)
        except Exception as exc:  # fastokens raises its own exceptions for what it does not implement
            raise InvalidArgumentError(f"fastokens does not load {source.label}: {type(exc).__name__}: {exc}") \
                from None
        self._flat = getattr(self.tok, "encode_batch_flat", None)

    def encode(self, texts, add_special_tokens: bool):
        if not texts:
            return np.empty(0, np.uint32), np.zeros(1, np.int64)
        if self._flat is None:  # releases before encode_batch_flat
            return _lists_to_flat([e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)])
        ids, offs = self._flat(texts, add_special_tokens=add_special_tokens)
        return np.frombuffer(ids, np.uint32), np.frombuffer(offs, np.uint64).astype(np.int64)


class TiktokenBackend(Backend):
    """tiktoken's ``encode_to_numpy`` per text (special tokens allowed, as HF tokenizers matches its
    added tokens), for a tiktoken-format vocabulary."""

    name = "tiktoken"

    def __init__(self, source: TokenizerSource):
        if source.tiktoken is None:
            raise InvalidArgumentError(f"the tiktoken backend needs a tiktoken-format tokenizer (a tiktoken.Encoding, "
                                       f"tiktoken:NAME, a .tiktoken file); {source.label} is a tokenizer.json")
        try:
            self.enc = source.tiktoken.encoding()
        except MCFError:
            raise
        except Exception as exc:  # tiktoken refuses the pattern or the ranks
            raise InvalidArgumentError(f"tiktoken does not load {source.label}: {type(exc).__name__}: {exc}") from None
        self._special = self.enc.special_tokens_set
        self._numpy = hasattr(self.enc, "encode_to_numpy")

    def encode(self, texts, add_special_tokens: bool):
        if self._numpy:
            parts = [self.enc.encode_to_numpy(t, allowed_special=self._special, disallowed_special=()) for t in texts]
            offsets = np.zeros(len(parts) + 1, np.int64)
            np.cumsum([len(p) for p in parts], out=offsets[1:])
            flat = np.concatenate(parts).astype(np.uint32, copy=False) if parts else np.empty(0, np.uint32)
            return flat, offsets
        return _lists_to_flat([self.enc.encode(t, allowed_special=self._special, disallowed_special=())
                               for t in texts])


def make_backend(name: str, source: TokenizerSource) -> Backend:
    """The backend ``name`` (not ``auto``) for ``source``; MissingDependencyError when its package is
    missing, InvalidArgumentError when it does not load the tokenizer."""
    if name == "hf":
        return HFBackend(source.hf)
    if name == "fastokens":
        return FastokensBackend(source)
    if name == "tiktoken":
        return TiktokenBackend(source)
    raise InvalidArgumentError(f"tokenizer backend must be one of {BACKENDS}, got {name!r}")


def probe_texts(source: TokenizerSource) -> list:
    """:data:`PROBE_TEXTS` and the tokenizer's added tokens (up to 64), each alone, next to text and
    repeated."""
    texts = list(PROBE_TEXTS)
    try:
        added = [t["content"] for t in json.loads(source.json).get("added_tokens", [])][:_ADDED_PROBED]
    except (ValueError, TypeError, KeyError):
        added = []
    for s in added:
        texts += [s, f"text{s}text", f" {s} ", s + s, f"a {s}\n{s[:-1]}", s.upper()]
    return texts


def _outcome(backend: Backend, texts: list, add_special_tokens: bool):
    """The ids of each text (a list of arrays) or, per text, the exception type's name when the batch
    is refused: a backend that refuses a text HF refuses (a lone surrogate) agrees with it."""
    try:
        ids, offs = backend.encode(texts, add_special_tokens)
        return [ids[offs[k]:offs[k + 1]] for k in range(len(texts))]
    except Exception:  # some text is refused: find which, one by one
        out = []
        for t in texts:
            try:
                ids, offs = backend.encode([t], add_special_tokens)
                out.append(ids[offs[0]:offs[1]])
            except Exception:
                out.append(None)
        return out


def probe_mismatch(backend: Backend, reference: Backend, source: TokenizerSource, *,
                   add_special_tokens: bool = False):
    """None when ``backend`` gives ``reference``'s ids on every probe text (and refuses the same ones),
    else a short description of the first difference."""
    texts = probe_texts(source)
    want = _outcome(reference, texts, add_special_tokens)
    got = _outcome(backend, texts, add_special_tokens)
    for t, w, g in zip(texts, want, got):
        if (w is None) != (g is None) or (w is not None and not np.array_equal(w, g)):
            shown = t if len(t) <= 40 else t[:37] + "..."
            if w is None:
                return f"it encodes {shown!r}, which HF tokenizers refuses"
            if g is None:
                return f"it refuses {shown!r}"
            return f"its ids differ from HF tokenizers' on {shown!r}"
    return None


_SAID: set = set()
_SAID_LOCK = threading.Lock()


def _say_once(key, message: str) -> None:
    with _SAID_LOCK:
        if key in _SAID:
            return
        _SAID.add(key)
    LOG.warning("%s", message)


_CHOSEN: dict = {}   # (tokenizer digest, backend asked, add_special_tokens) -> (Backend, note): probed once
_CHOSEN_KEPT = 4     # tokenizers whose backend a process keeps


def _remember(key, backend: Backend, note):
    with _SAID_LOCK:
        while len(_CHOSEN) >= _CHOSEN_KEPT:
            _CHOSEN.pop(next(iter(_CHOSEN)))
        _CHOSEN[key] = (backend, note)
    return backend, note


def choose_backend(source: TokenizerSource, backend: str, *, add_special_tokens: bool = False):
    """``(Backend, note)``: the backend ``backend`` names, checked on the probe (InvalidArgumentError when
    it fails it or does not load the tokenizer), or for ``auto`` the first of :data:`AUTO_ORDER` that
    loads the tokenizer and passes the probe, else HF tokenizers with ``note`` saying why (logged once
    per tokenizer and reason to the ``mcf.tokenize`` logger).  ``note`` is None when nothing needs saying."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"tokenizer backend must be one of {BACKENDS}, got {backend!r}")
    reference = HFBackend(source.hf)
    if backend == "hf":
        return reference, None
    key = (source.digest, backend, bool(add_special_tokens))
    known = _CHOSEN.get(key)
    if known is not None:
        return known
    if backend != "auto":
        b = make_backend(backend, source)
        why = probe_mismatch(b, reference, source, add_special_tokens=add_special_tokens)
        if why is not None:
            raise InvalidArgumentError(f"the {backend} backend does not tokenize {source.label} as HF tokenizers does: "
                                       f"{why}; use --tokenizer-backend hf or auto")
        return _remember(key, b, None)
    reasons = []
    for name in AUTO_ORDER:
        if name == "tiktoken" and source.tiktoken is None:
            continue
        try:
            b = make_backend(name, source)
        except ImportError:
            reasons.append(f"{name} is not installed")
            continue
        except MCFError as exc:
            reasons.append(str(exc))
            continue
        why = probe_mismatch(b, reference, source, add_special_tokens=add_special_tokens)
        if why is None:
            return _remember(key, b, None)
        reasons.append(f"{name}: {why}")
    note = f"tokenizing with HF tokenizers: {'; '.join(reasons)}"
    _say_once((source.digest, note), note)
    return _remember(key, reference, note)
