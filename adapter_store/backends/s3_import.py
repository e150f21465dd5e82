"""Reading an adapter's files from an S3 prefix (``s3://bucket/prefix``) for the store's Import.

The store imports with its own S3 client (the blob backend's: its endpoint, region and
credentials), so the inference server needs no S3 access of its own. The objects directly under
``prefix/`` are the files, as a folder's would be (``README.md`` and the like come too and are
not kept; a pickle is refused by the upload checks the store then runs). Sizes are checked from
the listing before any byte is read.
"""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from loraplex.adapter_store.errors import AdapterValidationError, InvalidRequestError, UnavailableError
from loraplex.adapter_store.upload import MAX_FILES

FIELD = "source"
# S3's answers that say the source is wrong, not that S3 is down
_CALLERS_CODES = {"NoSuchBucket", "NoSuchKey", "404", "NotFound", "AccessDenied", "403", "InvalidBucketName"}


def parse_source(source: str) -> tuple[str, str]:
    """(bucket, key prefix ending in "/" or "") of ``s3://bucket/prefix``; InvalidRequestError
    naming ``source`` otherwise."""
    if not source.startswith("s3://"):
        raise InvalidRequestError(f"{source!r} is not an s3://bucket/prefix URL", FIELD)
    bucket, _, prefix = source.removeprefix("s3://").partition("/")
    if not bucket:
        raise InvalidRequestError(f"{source!r} names no bucket (s3://bucket/prefix)", FIELD)
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


class S3Importer:
    """Reads the files under an S3 prefix with one boto3 S3 client (``client``); ``where`` names
    the endpoint in errors."""

    def __init__(self, client: Any, where: str) -> None:
        self._client = client
        self._where = where

    def read(self, source: str, max_bytes: int) -> dict[str, bytes]:
        """{file name: bytes} of the objects directly under ``source``'s prefix; InvalidRequestError
        (field ``source``) when there are none, too many or too many bytes, or S3 refuses the
        bucket; UnavailableError when S3 does not answer."""
        bucket, prefix = parse_source(source)
        listing = self._s3(source, lambda: self._client.list_objects_v2(
            Bucket=bucket, Prefix=prefix, Delimiter="/", MaxKeys=MAX_FILES + 1))
        objects = {o["Key"][len(prefix):]: int(o["Size"]) for o in listing.get("Contents", [])
                   if o["Key"][len(prefix):]}
        if not objects:
            raise InvalidRequestError(f"no files under {source!r} (a PEFT folder's adapter_config.json and "
                                      "adapter_model.safetensors, directly under the prefix)", FIELD)
        if len(objects) > MAX_FILES or listing.get("IsTruncated"):
            raise InvalidRequestError(f"more than {MAX_FILES} files under {source!r}; point it at one adapter's "
                                      "folder", FIELD)
        total = sum(objects.values())
        if total > max_bytes:
            raise AdapterValidationError(f"the adapter under {source!r} is {total} bytes, over the limit of "
                                         f"{max_bytes} bytes")
        return {name: self._s3(source, lambda key=prefix + name: self._client.get_object(
            Bucket=bucket, Key=key)["Body"].read()) for name in sorted(objects)}

    def _s3(self, source: str, fn: Any) -> Any:
        try:
            return fn()
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _CALLERS_CODES:
                raise InvalidRequestError(f"S3 refuses reading {source!r} with the store's credentials ({code})",
                                          FIELD) from None
            raise UnavailableError(f"S3 ({self._where}) failed reading {source!r}: {code}: {exc}") from None
        except BotoCoreError as exc:
            raise UnavailableError(f"S3 ({self._where}) is unreachable for {source!r}: {exc}") from None
