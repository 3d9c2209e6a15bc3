"""The remote tier's S3 client on boto3 (the official AWS SDK): see
:mod:`ckptstore.remote.client` for the interface, the options and why two clients.

boto3 exposes each primitive of the remote layout as one request: multipart uploads part by part
(memory is one part, the pacing sits between parts), conditional writes (``IfNoneMatch="*"``),
range GETs, batch deletes, the listing and abort of multipart uploads, and typed service error
codes. Its credential chain also reads ``~/.aws`` profiles.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..errors import CkptStoreError, RemoteError
from .client import ObjectStore, Pacer, RemoteURL, client_options


def _client_config(options: dict) -> tuple[dict, dict]:
    """(boto3 client kwargs, botocore Config kwargs) from an options dict."""
    opts = client_options(options)
    kw: dict[str, Any] = {}
    for ours, theirs in (("endpoint_url", "endpoint_url"), ("region_name", "region_name"),
                         ("region", "region_name"), ("key", "aws_access_key_id"),
                         ("secret", "aws_secret_access_key"), ("token", "aws_session_token"),
                         ("aws_access_key_id", "aws_access_key_id"),
                         ("aws_secret_access_key", "aws_secret_access_key"),
                         ("aws_session_token", "aws_session_token")):
        if opts.get(ours) is not None:
            kw[theirs] = opts[ours]
    cfg: dict[str, Any] = {
        "connect_timeout": float(opts.get("connect_timeout", 5)),
        "read_timeout": float(opts.get("read_timeout", 60)),
        "retries": {"max_attempts": int(opts.get("max_attempts", 3)), "mode": "standard"},
    }
    style = opts.get("addressing_style", "path" if kw.get("endpoint_url") else None)
    if style is not None:
        cfg["s3"] = {"addressing_style": style}
    if not kw.get("region_name"):
        kw["region_name"] = os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return kw, cfg


class Boto3Store(ObjectStore):
    """:class:`~ckptstore.remote.client.ObjectStore` on boto3 (thread-safe: boto3 clients are).
    """

    kind = "boto3"

    def __init__(self, url: str | RemoteURL, options: dict | None = None) -> None:
        super().__init__(url, options)
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError as e:
            raise self._not_installed(e) from e
        self._boto_errors = botocore.exceptions
        kw, cfg = _client_config(options or {})
        if client_options(options or {}).get("anon"):
            from botocore import UNSIGNED

            cfg["signature_version"] = UNSIGNED
        session = boto3.session.Session()
        self.client = session.client("s3", config=botocore.config.Config(**cfg), **kw)

    # ---- errors ---------------------------------------------------------------------------
    @contextmanager
    def errors(self, operation: str, name: str = "") -> Iterator[None]:
        """Turn botocore's errors raised inside the block into RemoteError naming the object."""
        try:
            yield
        except RemoteError:
            raise
        except self._boto_errors.ClientError as e:
            err = e.response.get("Error", {}) if isinstance(e.response, dict) else {}
            code = str(err.get("Code") or e.response.get("ResponseMetadata", {})
                       .get("HTTPStatusCode", ""))
            msg = str(err.get("Message") or code or e)
            raise self.error(operation, name, msg, code) from e
        except self._boto_errors.NoCredentialsError as e:
            raise RemoteError(operation, self.where.url(name), str(e), code="NoCredentials",
                              errno_=errno.EACCES) from e
        except (self._boto_errors.EndpointConnectionError,
                self._boto_errors.ConnectionClosedError,
                self._boto_errors.ConnectTimeoutError, self._boto_errors.ReadTimeoutError) as e:
            raise RemoteError(operation, self.where.url(name), str(e), code="Unreachable",
                              errno_=errno.ECONNREFUSED) from e
        except self._boto_errors.BotoCoreError as e:
            raise RemoteError(operation, self.where.url(name), str(e),
                              code=type(e).__name__) from e
        except OSError as e:  # a socket error botocore did not wrap
            if isinstance(e, CkptStoreError):
                raise  # a local error (reading the segment being uploaded): not the remote's
            raise RemoteError(operation, self.where.url(name), str(e), code="Unreachable",
                              errno_=e.errno or errno.EIO) from e

    # ---- requests -------------------------------------------------------------------------
    def check_bucket(self) -> None:
        """RemoteError (NoSuchBucket, AccessDenied, InvalidAccessKeyId, Unreachable) unless the
        bucket exists and these credentials reach it."""
        with self.errors("open bucket"):
            try:
                self.client.head_bucket(Bucket=self.where.bucket)
            except self._boto_errors.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                if code in ("404", "NoSuchBucket", "NotFound"):
                    raise RemoteError("open bucket", str(self.where),
                                      f"bucket {self.where.bucket!r} does not exist",
                                      code="NoSuchBucket", errno_=errno.ENOENT) from e
                if code in ("403", "AccessDenied"):  # HEAD has no body: ask for the real reason
                    self.client.list_objects_v2(Bucket=self.where.bucket, MaxKeys=1)
                raise

    def put(self, name: str, data: bytes, *, if_absent: bool = False,
            metadata: dict[str, str] | None = None) -> bool:
        """Write ``name`` whole. With ``if_absent`` the write is conditional (If-None-Match: *):
        returns False, writing nothing, when the object exists already."""
        extra: dict[str, Any] = {"Metadata": metadata} if metadata else {}
        if if_absent and self.conditional_writes:
            extra["IfNoneMatch"] = "*"
        with self.errors("put", name):
            try:
                self.client.put_object(Bucket=self.where.bucket, Key=self.where.key(name),
                                       Body=data, **extra)
            except self._boto_errors.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                if if_absent and code in ("PreconditionFailed", "412",
                                          "ConditionalRequestConflict"):
                    return False
                if "IfNoneMatch" in extra and code in ("NotImplemented", "501"):
                    # a service without conditional writes: the highest valid HEAD generation
                    # still wins for one writer (format-spec/remote.md R3)
                    self.conditional_writes = False
                    return self.put(name, data, if_absent=if_absent, metadata=metadata)
                raise
        return True

    def put_range(self, name: str, read: Callable[[int, int], bytes], length: int,
                  part_size: int, pacer: Pacer, metadata: dict[str, str] | None = None,
                  sent: Callable[[int], None] | None = None) -> None:
        """Write ``name`` from ``length`` bytes that ``read(offset, n)`` returns, at most
        ``part_size`` bytes in memory at a time: one PUT when it fits in a part, else a
        multipart upload (aborted when a part fails). ``pacer`` spaces the parts out."""
        if length <= part_size:
            data = read(0, length)
            pacer.take(len(data))
            self.put(name, data, metadata=metadata)
            if sent is not None:
                sent(len(data))
            return
        key = self.where.key(name)
        with self.errors("create multipart upload", name):
            upload = self.client.create_multipart_upload(
                Bucket=self.where.bucket, Key=key, **({"Metadata": metadata} if metadata else {}))
        upload_id = upload["UploadId"]
        try:
            parts = []
            for number, off in enumerate(range(0, length, part_size), start=1):
                data = read(off, min(part_size, length - off))
                pacer.take(len(data))
                with self.errors(f"upload part {number}", name):
                    r = self.client.upload_part(Bucket=self.where.bucket, Key=key,
                                                UploadId=upload_id, PartNumber=number, Body=data)
                parts.append({"PartNumber": number, "ETag": r["ETag"]})
                if sent is not None:
                    sent(len(data))
                del data
            with self.errors("complete multipart upload", name):
                self.client.complete_multipart_upload(
                    Bucket=self.where.bucket, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.where.bucket, Key=key,
                                                   UploadId=upload_id)
            except Exception:  # noqa: BLE001 - the first failure is what matters
                pass
            raise

    def size(self, name: str) -> int | None:
        """The length of ``name``, or None when it does not exist."""
        with self.errors("head", name):
            try:
                r = self.client.head_object(Bucket=self.where.bucket, Key=self.where.key(name))
            except self._boto_errors.ClientError as e:
                if str(e.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey",
                                                                          "NotFound"):
                    return None
                raise
        return int(r["ContentLength"])

    def stream(self, name: str, block: int, start: int = 0,
               length: int | None = None) -> Iterator[bytes]:
        """The bytes of ``name`` (or of a range) in blocks of at most ``block`` bytes."""
        extra: dict[str, Any] = {}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            extra["Range"] = f"bytes={start}-{end}"
        with self.errors("get", name):
            r = self.client.get_object(Bucket=self.where.bucket, Key=self.where.key(name),
                                       **extra)
            body = r["Body"]
            try:
                while True:
                    chunk = body.read(block)
                    if not chunk:
                        break
                    yield chunk
            finally:
                body.close()

    def list_objects(self, under: str = "") -> dict[str, int]:
        """name -> size of every object whose name starts with ``under``."""
        out: dict[str, int] = {}
        prefix = self.where.key(under) if under else (self.where.prefix + "/" if
                                                      self.where.prefix else "")
        with self.errors("list", under):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.where.bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    out[self.where.name_of(obj["Key"])] = int(obj["Size"])
        return out

    def delete(self, names: list[str]) -> None:
        """Delete ``names`` (absent ones are fine), 1000 per request."""
        for i in range(0, len(names), 1000):
            batch = names[i:i + 1000]
            with self.errors("delete", batch[0]):
                r = self.client.delete_objects(Bucket=self.where.bucket, Delete={
                    "Objects": [{"Key": self.where.key(n)} for n in batch], "Quiet": True})
            failed = r.get("Errors") or []
            if failed:
                f = failed[0]
                raise RemoteError("delete", self.where.url(self.where.name_of(f.get("Key", ""))),
                                  str(f.get("Message", "")), code=str(f.get("Code", "")))

    def abort_uploads(self) -> int:
        """Abort the multipart uploads left under the prefix by a process that died mid-upload
        (their parts are invisible but billed). Returns how many."""
        prefix = self.where.prefix + "/" if self.where.prefix else ""
        n = 0
        with self.errors("list multipart uploads"):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.where.bucket, Prefix=prefix)
            for page in pages:
                for u in page.get("Uploads", ()) or ():
                    try:
                        self.client.abort_multipart_upload(
                            Bucket=self.where.bucket, Key=u["Key"], UploadId=u["UploadId"])
                        n += 1
                    except self._boto_errors.ClientError:
                        pass  # finished or aborted meanwhile
        return n
