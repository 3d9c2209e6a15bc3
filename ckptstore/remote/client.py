"""The object-store client of the remote tier: S3 and S3-compatible services.

One interface, :class:`ObjectStore` (the requests the remote layout of format-spec/remote.md
needs, and nothing else), and two implementations of it: :class:`~.s3_obstore.ObstoreStore`
on obstore (the Python binding of the Rust ``object_store`` crate) and
:class:`~.s3_boto3.Boto3Store` on boto3. ``ObjectStore(url, options)`` returns the one the
``client`` option names (``"obstore"`` or ``"boto3"``; default: the environment variable
``CKPTSTORE_REMOTE_CLIENT``, else :data:`DEFAULT_CLIENT` when it is installed, else the other;
boto3 first in a process forked from one that had used obstore, which is not fork-safe). Either
is an optional dependency, imported only when a remote is used.

Why obstore by default: it does every request the layout needs (conditional create through
``If-None-Match: *``, multipart uploads from an iterator of parts with bounded memory and the
pacing between parts, range GETs, listing, batch deletes, the service's error codes), in one
16 MB wheel with no dependencies (boto3 + botocore + s3transfer: 25 MB, 27 MB with their
dependencies; botocore's tight pins are what made pip backtrack beside s3fs, issue 32); its
import and client take ~40 ms against boto3's ~0.4-0.8 s; its requests run in Rust with the GIL
released, so the lazy reader's concurrent range GETs overlap. Against the same moto server
(tools/bench_objstore.py, docs/remote.md) pulls and lazy loads were ~1.7x faster, small range
GETs 1.8x, pushes 1.2x, with a fifth of boto3's client CPU on range reads (moto's own CPU is most
of the wall time). What it lacks: listing (and so aborting) the multipart uploads a killed
process left; with boto3 installed too that one request goes through boto3
(:mod:`.s3_obstore`). boto3 stays selectable (``client="boto3"``; it also reads ``~/.aws``
profiles) and tested.

Every failure leaves here as a :class:`~ckptstore.errors.RemoteError` (or a subclass) naming the
operation, the object's URL and the service's code (``NoSuchBucket``, ``NoSuchKey``,
``InvalidAccessKeyId``, ``AccessDenied``, ``InvalidRange``, ``Unreachable``, ...), the same
codes from both clients; nothing of either client's own exceptions escapes.

Options (``storage_options`` / ``remote_options``, the same keys as s3fs where they exist, so one
dict serves both): ``client`` (above), ``endpoint_url``, ``region_name`` (or ``region``),
``key`` / ``secret`` / ``token`` (or ``aws_access_key_id`` / ``aws_secret_access_key`` /
``aws_session_token``; default: the client's usual chain, environment variables included),
``client_kwargs`` (a dict merged into these, as s3fs takes it), ``connect_timeout`` (s, default
5), ``read_timeout`` (s without a byte read, default 60), ``max_attempts`` (tries per request,
retries included, default 3), ``addressing_style`` ("path" or "virtual"; default: path style
with an ``endpoint_url``, else the client's own default), ``anon`` (unsigned requests).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import RemoteError, RemoteUnsupportedError

#: The smallest part S3 accepts in a multipart upload (every part but the last).
MIN_PART_SIZE = 5 << 20
#: The client ``ObjectStore(...)`` picks when neither the options nor the environment name one.
DEFAULT_CLIENT = "obstore"
#: The implementations: client name -> (module, class).
CLIENTS = {"obstore": ("ckptstore.remote.s3_obstore", "ObstoreStore"),
           "boto3": ("ckptstore.remote.s3_boto3", "Boto3Store")}
#: Client options (the rest of an options dict belongs to the uploader).
CLIENT_KEYS = frozenset({"client", "endpoint_url", "region_name", "region", "key", "secret",
                         "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                         "client_kwargs", "connect_timeout", "read_timeout", "max_attempts",
                         "addressing_style", "anon"})

#: Service error codes -> (errno, our code) for errors that are not plain I/O failures.
_ERRNO = {
    "NoSuchBucket": errno.ENOENT, "NoSuchKey": errno.ENOENT, "404": errno.ENOENT,
    "NotFound": errno.ENOENT, "AccessDenied": errno.EACCES, "403": errno.EACCES,
    "InvalidAccessKeyId": errno.EACCES, "SignatureDoesNotMatch": errno.EACCES,
    "ExpiredToken": errno.EACCES, "InvalidToken": errno.EACCES,
}


class Cancelled(Exception):
    """Raised inside an upload when its owner is stopping (internal: never reaches a caller)."""


@dataclass(frozen=True)
class RemoteURL:
    """``s3://bucket/prefix``: where one store's objects live (every key starts with prefix/)."""

    bucket: str
    prefix: str

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def name_of(self, key: str) -> str:
        """The name below the prefix of a listed ``key``."""
        return key[len(self.prefix) + 1:] if self.prefix else key

    def url(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(name)}" if name else str(self)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def is_remote_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def parse_url(url: str) -> RemoteURL:
    """Split ``s3://bucket/prefix``; RemoteUnsupportedError for another scheme or no bucket."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a"):
        raise RemoteUnsupportedError(f"remote {url!r}: only s3:// URLs are supported")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or any(p in (".", "..") for p in prefix.split("/") if prefix):
        raise RemoteUnsupportedError(f"remote {url!r}: expected s3://BUCKET[/PREFIX]")
    return RemoteURL(bucket, prefix)


class Pacer:
    """Bounds the average upload rate: before ``n`` bytes go out, wait until the bytes sent
    before them have had their time at ``rate`` bytes/s (a leaky bucket; the first request is
    not delayed). ``rate`` None: no bound. Waits end early with :class:`Cancelled` when
    ``cancel`` is set."""

    def __init__(self, rate: float | None, cancel: threading.Event | None = None) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(f"bandwidth must be a positive number of bytes/s, not {rate!r}")
        self.rate = rate
        self.cancel = cancel
        self._free = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free)
            self._free = start + n / self.rate
        delay = start - now
        if delay > 0:
            if self.cancel is not None:
                if self.cancel.wait(delay):
                    raise Cancelled()
            else:
                time.sleep(delay)




def client_name(options: dict | None) -> str:
    """The client an options dict selects (see the module's docstring)."""
    name = (options or {}).get("client") or os.environ.get("CKPTSTORE_REMOTE_CLIENT") or ""
    if name:
        if name not in CLIENTS:
            raise ValueError(f"remote option client={name!r}: expected one of {sorted(CLIENTS)}")
        return str(name)
    order = [DEFAULT_CLIENT, *sorted(set(CLIENTS) - {DEFAULT_CLIENT})]
    ob = sys.modules.get("ckptstore.remote.s3_obstore")
    if ob is not None and ob.forked_after_use():
        order.remove("obstore")  # a child forked after obstore ran here: boto3 if installed
        order.append("obstore")
    for name in order:
        if importlib.util.find_spec(name) is not None:
            return name
    return order[0]  # none installed: its import error names the extra to install


def _implementation(name: str) -> "type[ObjectStore]":
    """The class of client ``name`` (a key of :data:`CLIENTS`, as :func:`client_name` checks),
    imported by the name the table gives (the implementations import this module)."""
    module, cls_name = CLIENTS[name]
    cls: type[ObjectStore] = getattr(importlib.import_module(module), cls_name)
    return cls


def client_options(options: dict) -> dict:
    """One flat dict of an options dict's client keys (``client_kwargs`` merged in)."""
    opts = {k: v for k, v in options.items() if k in CLIENT_KEYS}
    opts.update(opts.pop("client_kwargs", None) or {})
    return opts


class ObjectStore:
    """The objects of one store under ``s3://bucket/prefix`` (thread-safe).

    ``ObjectStore(url, options)`` returns an instance of the implementation the options select
    (:func:`client_name`); the methods below are what the remote tier asks of it, each one or a
    few requests, every failure a :class:`~ckptstore.errors.RemoteError`."""

    #: the client's name ("obstore", "boto3")
    kind = ""

    def __new__(cls, url: str | RemoteURL, options: dict | None = None) -> "ObjectStore":
        if cls is ObjectStore:
            cls = _implementation(client_name(options))
        return super().__new__(cls)

    def __init__(self, url: str | RemoteURL, options: dict | None = None) -> None:
        self.where = url if isinstance(url, RemoteURL) else parse_url(url)
        #: the service honours If-None-Match on PUT (cleared when it answers NotImplemented)
        self.conditional_writes = True

    def _not_installed(self, e: ImportError) -> RemoteUnsupportedError:
        return RemoteUnsupportedError(
            f"remote {self.where}: the S3 client {self.kind} is not installed (pip install "
            f"'ckptstore[remote]', or the remote option client= naming one that is): {e}")

    def error(self, operation: str, name: str, message: str, code: str) -> RemoteError:
        """The typed error of a service answer ``code`` (errno from it)."""
        return RemoteError(operation, self.where.url(name), message, code=code,
                           errno_=_ERRNO.get(code, errno.EIO))

    # ---- requests -------------------------------------------------------------------------
    def check_bucket(self) -> None:
        """RemoteError (NoSuchBucket, AccessDenied, InvalidAccessKeyId, Unreachable) unless the
        bucket exists and these credentials reach it."""
        raise NotImplementedError

    def put(self, name: str, data: bytes, *, if_absent: bool = False,
            metadata: dict[str, str] | None = None) -> bool:
        """Write ``name`` whole. With ``if_absent`` the write is conditional (If-None-Match: *):
        returns False, writing nothing, when the object exists already."""
        raise NotImplementedError

    def put_range(self, name: str, read: Callable[[int, int], bytes], length: int,
                  part_size: int, pacer: Pacer, metadata: dict[str, str] | None = None,
                  sent: Callable[[int], None] | None = None) -> None:
        """Write ``name`` from ``length`` bytes that ``read(offset, n)`` returns, a bounded
        number of ``part_size`` parts in memory at a time: one PUT when it fits in a part, else
        a multipart upload (aborted when a part fails). ``pacer`` spaces the parts out;
        ``sent(n)`` is told of each part sent."""
        raise NotImplementedError

    def size(self, name: str) -> int | None:
        """The length of ``name``, or None when it does not exist."""
        raise NotImplementedError

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """The bytes of ``name`` (a range of them with ``start``/``length``: at most ``length``
        bytes, fewer where the object ends first; InvalidRange when ``start`` is past its
        end)."""
        return b"".join(self.stream(name, 8 << 20, start, length))

    def stream(self, name: str, block: int, start: int = 0,
               length: int | None = None) -> Iterator[bytes]:
        """The bytes of ``name`` (or of a range) in blocks of at most ``block`` bytes."""
        raise NotImplementedError

    def list_objects(self, under: str = "") -> dict[str, int]:
        """name -> size of every object below ``under`` ("" or a name ending in "/")."""
        raise NotImplementedError

    def delete(self, names: list[str]) -> None:
        """Delete ``names`` (absent ones are fine), 1000 per request."""
        raise NotImplementedError

    def abort_uploads(self) -> int:
        """Abort the multipart uploads left under the prefix by a process that died mid-upload
        (their parts are invisible but billed). Returns how many."""
        raise NotImplementedError
