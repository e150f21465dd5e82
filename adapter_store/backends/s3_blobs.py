"""Blob backend on S3 (or any S3-compatible endpoint) through boto3.

Keys under the configured prefix: ``heads/<id>`` (the head: one small JSON object; its
PUT is the commit point), ``blobs/<id>@<version>`` and ``store-marker`` (blob_marker.py). Large blobs go up as multipart
uploads (boto3's transfer manager aborts a failed multipart upload, leaving nothing).
Credentials come from the standard AWS chain (environment, profile, instance role).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError, ProfileNotFound

from loraplex.adapter_store.backends.base import ANY_HEAD
from loraplex.adapter_store.backends.s3_import import S3Importer
from loraplex.adapter_store.errors import BackendUnavailable, BlobMissing, HeadChanged
from loraplex.adapter_store.settings import S3Settings

T = TypeVar("T")
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_CHANGED_CODES = ("PreconditionFailed:", "412:", "ConditionalRequestConflict:")
# Answers that say a setting is wrong, not that S3 is down: the fix each one needs.
CREDENTIALS_FIX = ("give the store S3 credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                   "--s3-profile, or an instance role / IRSA")
_SETTING_FIXES = {
    "NoSuchBucket": "create the bucket first, or check --s3-bucket and --s3-endpoint-url",
    "InvalidAccessKeyId": "the access key is not known to this endpoint: check AWS_ACCESS_KEY_ID (or --s3-profile)",
    "SignatureDoesNotMatch": "the secret key does not match the access key: check AWS_SECRET_ACCESS_KEY",
    "InvalidToken": "the session token is not valid: check AWS_SESSION_TOKEN",
    "ExpiredToken": "the session token expired: renew the credentials",
    "AccessDenied": "the credentials may not list the bucket: grant s3:ListBucket, s3:GetObject, s3:PutObject and "
                    "s3:DeleteObject on it",
}


class S3BlobBackend:
    """Heads and version blobs as S3 objects."""

    def __init__(self, settings: S3Settings) -> None:
        self._bucket = settings.bucket
        self._prefix = settings.prefix
        config = Config(
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            retries={"max_attempts": settings.max_attempts, "mode": "standard"},
        )
        try:
            session = boto3.session.Session(profile_name=settings.profile or None)
        except ProfileNotFound as e:
            raise ValueError(f"s3: --s3-profile {settings.profile!r}: {e}") from None
        self._client = session.client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region, config=config
        )
        self._transfer = TransferConfig(
            multipart_threshold=settings.multipart_threshold, multipart_chunksize=settings.multipart_chunksize
        )
        where = f" at {settings.endpoint_url}" if settings.endpoint_url else ""
        self.description = f"S3 bucket {settings.bucket!r}{where}"
        self._marker = f"{self._prefix}store-marker"  # outside heads/ and blobs/

    def importer(self) -> S3Importer:
        """An importer of adapters from other S3 prefixes, with this backend's client (its endpoint
        and credentials): the store's Import."""
        return S3Importer(self._client, self.description)

    def _call(self, fn: Callable[[], T], missing_ok: bool = False) -> T:
        """fn(), its failures as BackendUnavailable; where ``missing_ok`` (reading one key), a
        "no such key" answer is re-raised as the ClientError for the caller to read as missing.
        Anywhere else (a write, a list, a delete) a 404 means the endpoint or bucket is wrong."""
        try:
            return fn()
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if missing_ok and code in _MISSING_CODES:
                raise
            raise BackendUnavailable(self.description, f"{code}: {e}", _SETTING_FIXES.get(code)) from e
        except (NoCredentialsError, PartialCredentialsError) as e:  # nothing to sign with: a setting
            raise BackendUnavailable(self.description, str(e), CREDENTIALS_FIX) from e
        except BotoCoreError as e:  # connection refused, timeouts, closed connections
            raise BackendUnavailable(self.description, str(e)) from e

    def _blob(self, key: str) -> str:
        return f"{self._prefix}blobs/{key}"

    def _head(self, adapter_id: str) -> str:
        return f"{self._prefix}heads/{adapter_id}"

    def _get(self, key: str) -> bytes | None:
        try:
            obj = self._call(lambda: self._client.get_object(Bucket=self._bucket, Key=key), missing_ok=True)
            return self._call(lambda: obj["Body"].read())
        except ClientError:  # only the "missing" codes reach here
            return None

    def write_blob(self, key: str, data: bytes) -> None:
        self._call(
            lambda: self._client.upload_fileobj(
                io.BytesIO(data), self._bucket, self._blob(key), Config=self._transfer
            )
        )

    def read_blob(self, key: str) -> bytes:
        data = self._get(self._blob(key))
        if data is None:
            raise BlobMissing(key)
        return data

    def delete_blob(self, key: str) -> None:
        self._call(lambda: self._client.delete_object(Bucket=self._bucket, Key=self._blob(key)))

    def list_blobs(self, adapter_id: str, modified_before: float | None = None) -> list[str]:
        start = len(self._blob(""))
        keep = None if modified_before is None else (lambda obj: obj["LastModified"].timestamp() < modified_before)
        return [k[start:] for k in self._list(self._blob(f"{adapter_id}@"), "", 10_000, keep)]

    def write_head(self, adapter_id: str, data: bytes, expect: str | None | object = ANY_HEAD) -> None:
        kwargs = {} if expect is ANY_HEAD else {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}
        self._conditional(adapter_id, lambda: self._client.put_object(
            Bucket=self._bucket, Key=self._head(adapter_id), Body=data, ContentType="application/json", **kwargs
        ))

    def read_head(self, adapter_id: str) -> bytes | None:
        return self._get(self._head(adapter_id))

    def read_head_tagged(self, adapter_id: str) -> tuple[bytes, str] | None:
        try:
            obj = self._call(lambda: self._client.get_object(Bucket=self._bucket, Key=self._head(adapter_id)),
                             missing_ok=True)
            return self._call(lambda: obj["Body"].read()), obj["ETag"]
        except ClientError:  # only the "missing" codes reach here
            return None

    def delete_head(self, adapter_id: str, expect: str | None | object = ANY_HEAD) -> None:
        if expect is None:  # "no head": nothing to delete, unless one appeared
            if self.read_head_tagged(adapter_id) is not None:
                raise HeadChanged(adapter_id)
            return
        kwargs = {} if expect is ANY_HEAD else {"IfMatch": expect}
        self._conditional(adapter_id, lambda: self._client.delete_object(
            Bucket=self._bucket, Key=self._head(adapter_id), **kwargs
        ))

    def _conditional(self, adapter_id: str, fn: Callable[[], object]) -> None:
        """A head write or delete; S3's "precondition failed" (the head changed since it was
        read) is HeadChanged, anything else as _call says."""
        try:
            self._call(fn)
        except BackendUnavailable as e:
            if e.detail.startswith(_CHANGED_CODES):
                raise HeadChanged(adapter_id) from None
            raise

    def list_heads(self, prefix: str, start_after: str, limit: int) -> list[str]:
        start = len(self._head(""))
        after = self._head(start_after) if start_after else ""
        return [k[start:] for k in self._list(self._head(prefix), after, limit)]

    def create_marker(self, data: bytes) -> bytes:
        try:
            self._call(lambda: self._client.put_object(Bucket=self._bucket, Key=self._marker, Body=data,
                                                       IfNoneMatch="*"))
            return data
        except BackendUnavailable as e:
            if not e.detail.startswith(_CHANGED_CODES):
                raise
        found = self.read_marker()  # another store created it first
        if found is None:
            raise BackendUnavailable(self.description, "its marker vanished while being created")
        return found

    def read_marker(self) -> bytes | None:
        return self._get(self._marker)

    def _list(self, prefix: str, start_after: str, limit: int,
              keep: Callable[[dict], bool] | None = None) -> list[str]:
        """Keys under ``prefix`` after ``start_after`` (at most ``limit``), of the objects ``keep``
        takes (all without it)."""
        keys: list[str] = []
        kwargs = {"Bucket": self._bucket, "Prefix": prefix}
        if start_after:
            kwargs["StartAfter"] = start_after
        while len(keys) < limit:
            kwargs["MaxKeys"] = min(1000, limit - len(keys))
            page = self._call(lambda: self._client.list_objects_v2(**kwargs))
            keys.extend(obj["Key"] for obj in page.get("Contents", []) if keep is None or keep(obj))
            if not page.get("IsTruncated"):
                break
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
        return keys
