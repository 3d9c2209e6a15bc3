"""The remote tier's S3 client on obstore (the Python binding of the Rust ``object_store`` crate):
see :mod:`ckptstore.remote.client` for the interface, the options and why two clients.

Each primitive of the remote layout is one call: ``put(mode="create")`` is the conditional
create (If-None-Match: *; AlreadyExistsError on 412), ``put`` of an iterator of parts a multipart
upload (``chunk_size`` = our part size; the iterator reads and paces each part, and the upload is
aborted when it raises or a part fails), ``get_range`` / ``get(...).stream()`` range GETs (in
Rust, the GIL released: concurrent readers' requests overlap), ``list``, ``delete`` (batch
DeleteObjects), ``head``. Errors come back as obstore exceptions whose text carries the HTTP
status and the service's XML error body: the ``<Code>`` in it is our error code.

What obstore does not have: ListMultipartUploads / AbortMultipartUpload of an upload another
process started (``object_store`` aborts its own failed uploads, but offers no listing), so
:meth:`ObstoreStore.abort_uploads` cannot find the parts a SIGKILLed writer left; it delegates to
boto3 where boto3 is installed, and otherwise returns 0 (a bucket lifecycle rule
AbortIncompleteMultipartUpload then removes them; format-spec/remote.md §5.4). Credentials: the
options, else the ``AWS_*`` environment variables, web identity, ECS or EC2 instance metadata
(not ``~/.aws`` profiles).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..errors import CkptStoreError, RemoteError, RemoteUnsupportedError
from .client import ObjectStore, Pacer, RemoteURL, client_options

if TYPE_CHECKING:
    from obstore import GetOptions
    from obstore.store import S3Store

#: Parts of one multipart upload in flight at a time (memory: this many parts plus the one the
#: iterator is reading).
UPLOAD_CONCURRENCY = 2
#: The longest a whole request may take (object_store's default is 30 s, too short for a large
#: object over a slow link); stalls are caught by ``read_timeout`` instead.
REQUEST_TIMEOUT = timedelta(hours=1)

log = logging.getLogger("ckptstore")
_told_abort = False  # the note that dead multipart uploads stay: once per process
#: the process that started obstore's Rust runtime (its threads do not survive a fork: a forked
#: child's requests would hang, and could stall the parent's; such a child is refused instead)
runtime_pid: int | None = None


def forked_after_use() -> bool:
    """Whether this process was forked from one that had used obstore."""
    return runtime_pid is not None and runtime_pid != os.getpid()

_CODE = re.compile(r"<Code>([^<]+)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_STATUS = re.compile(r"status code: (\d{3})")
#: markers of a request that got no HTTP answer (connect refused or reset, timeouts)
_UNREACHABLE = ("HTTP error", "error sending request", "connection", "Connection", "timed out",
                "Timeout")


def _store_config(where: RemoteURL, options: dict) -> dict[str, Any]:
    """S3Store keyword arguments from an options dict."""
    opts = client_options(options)
    kw: dict[str, Any] = {}
    for ours, theirs in (("endpoint_url", "endpoint"), ("region_name", "region"),
                         ("region", "region"), ("key", "access_key_id"),
                         ("secret", "secret_access_key"), ("token", "session_token"),
                         ("aws_access_key_id", "access_key_id"),
                         ("aws_secret_access_key", "secret_access_key"),
                         ("aws_session_token", "session_token")):
        if opts.get(ours) is not None:
            kw[theirs] = str(opts[ours])
    if not kw.get("region"):
        kw["region"] = os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    if opts.get("addressing_style") == "virtual":
        kw["virtual_hosted_style_request"] = True
    if opts.get("anon"):
        kw["skip_signature"] = True
    client: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=float(opts.get("connect_timeout", 5))),
        "read_timeout": timedelta(seconds=float(opts.get("read_timeout", 60))),
        "timeout": REQUEST_TIMEOUT,
    }
    if str(kw.get("endpoint", "")).startswith("http://"):
        client["allow_http"] = True
    retries = max(0, int(opts.get("max_attempts", 3)) - 1)
    return {"prefix": where.prefix or None, "client_options": client,
            "retry_config": {"max_retries": retries}, **kw}


class ObstoreStore(ObjectStore):
    """:class:`~ckptstore.remote.client.ObjectStore` on obstore (thread-safe: S3Store is)."""

    kind = "obstore"

    def __init__(self, url: str | RemoteURL, options: dict | None = None) -> None:
        global runtime_pid
        super().__init__(url, options)
        self._check_fork()
        try:
            import obstore
            import obstore.exceptions
            from obstore.store import S3Store
        except ImportError as e:
            raise self._not_installed(e) from e
        self._ob = obstore
        self._exc = obstore.exceptions
        self._options = dict(options or {})
        try:
            self.s3: S3Store = S3Store(self.where.bucket, **_store_config(self.where,
                                                                          self._options))
        except (self._exc.BaseError, ValueError) as e:
            raise RemoteError("configure client", str(self.where), str(e).split("\n")[0],
                              code="InvalidConfiguration", errno_=errno.EINVAL) from e
        if runtime_pid is None:
            runtime_pid = os.getpid()

    def _check_fork(self) -> None:
        if forked_after_use():
            raise RemoteUnsupportedError(
                f"remote {self.where}: obstore cannot be used in a process forked from one that "
                f"used it (its Rust runtime's threads do not survive fork; requests would hang): "
                f"use the remote option client='boto3' here, or start the process with the "
                f"'spawn' or 'forkserver' method")

    # ---- errors ---------------------------------------------------------------------------
    def _code(self, e: BaseException) -> tuple[str, str]:
        """(our code, a one-line message) of an obstore error."""
        text = str(e)
        head = text.split("\n\nDebug source:")[0]
        code = _CODE.search(head)
        message = _MESSAGE.search(head)
        msg = message.group(1) if message else head.split("\n")[0]
        if code:
            return code.group(1), msg
        if isinstance(e, self._exc.AlreadyExistsError):
            return "PreconditionFailed", msg
        status = _STATUS.search(head)
        if status:
            return status.group(1), msg
        if isinstance(e, FileNotFoundError):
            return "404", msg
        if isinstance(e, (self._exc.PermissionDeniedError, self._exc.UnauthenticatedError)):
            return "403", msg
        if any(m in head for m in _UNREACHABLE):
            return "Unreachable", msg
        return type(e).__name__, msg

    @contextmanager
    def errors(self, operation: str, name: str = "") -> Iterator[None]:
        """Turn obstore's errors raised inside the block into RemoteError naming the object."""
        self._check_fork()
        try:
            yield
        except (RemoteError, CkptStoreError):
            raise  # ours, or a local error (reading the segment being uploaded)
        except (self._exc.BaseError, FileNotFoundError) as e:
            code, msg = self._code(e)
            if code == "Unreachable":
                raise RemoteError(operation, self.where.url(name), msg, code=code,
                                  errno_=errno.ECONNREFUSED) from e
            raise self.error(operation, name, msg, code) from e
        except OSError as e:  # a socket error obstore did not wrap
            raise RemoteError(operation, self.where.url(name), str(e), code="Unreachable",
                              errno_=e.errno or errno.ECONNREFUSED) from e

    # ---- requests -------------------------------------------------------------------------
    def check_bucket(self) -> None:
        with self.errors("open bucket"):
            try:
                next(iter(self._ob.list(self.s3, None, chunk_size=1)), None)
            except FileNotFoundError as e:
                raise RemoteError("open bucket", str(self.where),
                                  f"bucket {self.where.bucket!r} does not exist",
                                  code="NoSuchBucket", errno_=errno.ENOENT) from e
            except self._exc.BaseError as e:
                if self._code(e)[0] in ("NoSuchBucket", "404"):
                    raise RemoteError("open bucket", str(self.where),
                                      f"bucket {self.where.bucket!r} does not exist",
                                      code="NoSuchBucket", errno_=errno.ENOENT) from e
                raise

    def put(self, name: str, data: bytes, *, if_absent: bool = False,
            metadata: dict[str, str] | None = None) -> bool:
        conditional = if_absent and self.conditional_writes
        with self.errors("put", name):
            try:
                self._ob.put(self.s3, name, data, mode="create" if conditional else "overwrite",
                             attributes=dict(metadata) if metadata else None, use_multipart=False)
            except (self._exc.AlreadyExistsError, self._exc.PreconditionError):
                if if_absent:
                    return False
                raise
            except (self._exc.BaseError, FileNotFoundError) as e:
                if conditional and self._code(e)[0] in ("NotImplemented", "501"):
                    # a service without conditional writes: the highest valid HEAD generation
                    # still wins for one writer (format-spec/remote.md R3)
                    self.conditional_writes = False
                    return self.put(name, data, if_absent=if_absent, metadata=metadata)
                raise
        return True

    def put_range(self, name: str, read: Callable[[int, int], bytes], length: int,
                  part_size: int, pacer: Pacer, metadata: dict[str, str] | None = None,
                  sent: Callable[[int], None] | None = None) -> None:
        if length <= part_size:
            data = read(0, length)
            pacer.take(len(data))
            self.put(name, data, metadata=metadata)
            if sent is not None:
                sent(len(data))
            return

        def parts() -> Iterator[bytes]:
            # called by obstore for the next part (the one before is in flight, or sent)
            for off in range(0, length, part_size):
                data = read(off, min(part_size, length - off))
                pacer.take(len(data))
                if sent is not None:
                    sent(len(data))
                yield data

        with self.errors("multipart upload", name):
            # a raise inside parts() (Cancelled, a local read error) or a failed part aborts
            # the upload; the exception comes back out unchanged
            self._ob.put(self.s3, name, parts(), use_multipart=True, chunk_size=part_size,
                         max_concurrency=UPLOAD_CONCURRENCY,
                         attributes=dict(metadata) if metadata else None)

    def size(self, name: str) -> int | None:
        with self.errors("head", name):
            try:
                return int(self._ob.head(self.s3, name)["size"])
            except FileNotFoundError:
                return None

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if length is not None:
            if length <= 0:
                return b""
            with self.errors("get", name):
                return bytes(self._ob.get_range(self.s3, name, start=start, length=length))
        return super().get(name, start, length)

    def stream(self, name: str, block: int, start: int = 0,
               length: int | None = None) -> Iterator[bytes]:
        options: GetOptions = {}
        if length is not None:
            options["range"] = (start, start + length)
        elif start:
            options["range"] = {"offset": start}
        with self.errors("get", name):
            r = self._ob.get(self.s3, name, options=options)
            # obstore gathers the network's small reads into chunks of at least half a block
            # (rarely more than one block: those are cut); one copy into bytes each
            for chunk in r.stream(min_chunk_size=max(1, block // 2)):
                if len(chunk) <= block:
                    yield bytes(chunk)
                else:
                    view = memoryview(chunk)
                    for at in range(0, len(view), block):
                        yield bytes(view[at:at + block])

    def list_objects(self, under: str = "") -> dict[str, int]:
        if under and not under.endswith("/"):
            raise ValueError(f"list_objects({under!r}): a prefix ends in '/'")
        out: dict[str, int] = {}
        with self.errors("list", under):
            for batch in self._ob.list(self.s3, under.rstrip("/") or None, chunk_size=1000):
                for obj in batch:
                    out[obj["path"]] = int(obj["size"])
        return out

    def delete(self, names: list[str]) -> None:
        for i in range(0, len(names), 1000):
            batch = names[i:i + 1000]
            with self.errors("delete", batch[0]):
                self._ob.delete(self.s3, batch)  # one DeleteObjects; absent names are fine

    def abort_uploads(self) -> int:
        # obstore cannot list multipart uploads (see the module's docstring): boto3's listing
        # and abort where it is installed, else nothing (a lifecycle rule removes them)
        try:
            import boto3  # noqa: F401
        except ImportError:
            global _told_abort
            if not _told_abort:
                _told_abort = True
                log.info("remote %s: multipart uploads a killed writer left are not aborted "
                         "(obstore cannot list them; install boto3, or give the bucket an "
                         "AbortIncompleteMultipartUpload lifecycle rule)", self.where)
            return 0
        from .s3_boto3 import Boto3Store

        return Boto3Store(self.where, self._options).abort_uploads()
