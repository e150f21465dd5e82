"""Copy a base model from S3 into a local folder (the chart's fetch-model init container).

Every object under ``s3://BUCKET/PREFIX/`` is copied to ``DEST``, keeping its path relative
to the prefix; a prefix that names one object (e.g. a .gguf file) copies that file alone.
Files already present with the right size are kept, so a restarted init container resumes.
Each file is written under a temporary name and renamed when complete: the server never
sees half a file. Credentials come from the standard AWS settings (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, a web identity token, ...). Exit status: 0 copied, 1 failed, 2 bad use.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fetch_model", description="Copy a model folder or file from S3.")
    p.add_argument("--bucket", required=True, help="S3 bucket")
    p.add_argument("--prefix", default="", help="folder (key prefix) or the key of one file")
    p.add_argument("--dest", required=True, help="local folder to copy into")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (MinIO, ...); default: AWS")
    p.add_argument("--region", default=None, help="S3 region")
    args = p.parse_args(argv)
    if not args.bucket.strip():
        p.error("--bucket must not be empty")
    return args


def relative_path(key: str, prefix: str) -> PurePosixPath:
    """The local path of ``key`` under ``prefix``; ValueError for a key that would escape DEST."""
    rel = PurePosixPath(key[len(prefix):])
    if rel.is_absolute() or not rel.parts or any(part in ("..", ".", "") for part in rel.parts):
        raise ValueError(f"refusing object key {key!r}: its path under the prefix is not a plain relative path")
    return rel


def list_objects(s3, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:  # noqa: ANN001  (boto3 client)
    """(key, size) of every object under ``prefix``, folder markers left out."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if not obj["Key"].endswith("/"):
                yield obj["Key"], int(obj["Size"])


def plan(s3, bucket: str, prefix: str) -> list[tuple[str, PurePosixPath, int]]:  # noqa: ANN001
    """(key, local relative path, size) of what to copy. A prefix naming an object is that file."""
    exact = [(key, size) for key, size in list_objects(s3, bucket, prefix) if key == prefix] if prefix else []
    if exact:
        key, size = exact[0]
        return [(key, PurePosixPath(PurePosixPath(key).name), size)]
    folder = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    return [(key, relative_path(key, folder), size) for key, size in list_objects(s3, bucket, folder)]


def copy_one(s3, bucket: str, key: str, target: Path, size: int) -> bool:  # noqa: ANN001
    """Download ``key`` to ``target`` atomically; False when a complete copy was already there."""
    if target.is_file() and target.stat().st_size == size:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    s3.download_file(bucket, key, str(partial))
    got = partial.stat().st_size
    if got != size:
        partial.unlink(missing_ok=True)
        raise OSError(f"s3://{bucket}/{key}: got {got} bytes, the listing said {size}")
    os.replace(partial, target)
    return True


def fetch(s3, bucket: str, prefix: str, dest: Path) -> int:  # noqa: ANN001
    """Copy everything ``plan`` finds into ``dest``; return the number of files in the model."""
    items = plan(s3, bucket, prefix)
    if not items:
        raise FileNotFoundError(f"no objects under s3://{bucket}/{prefix} (check model.s3.bucket and model.s3.prefix)")
    total = sum(size for _, _, size in items)
    print(f"fetch_model: {len(items)} file(s), {total / 2**20:.1f} MiB from s3://{bucket}/{prefix} to {dest}",
          flush=True)
    start = time.monotonic()
    for key, rel, size in items:
        copied = copy_one(s3, bucket, key, dest / rel, size)
        print(f"fetch_model: {'copied' if copied else 'kept  '} {rel} ({size / 2**20:.1f} MiB)", flush=True)
    print(f"fetch_model: done in {time.monotonic() - start:.1f}s", flush=True)
    return len(items)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import boto3  # noqa: PLC0415  (after argument errors, which need no boto3)
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

    s3 = boto3.client("s3", endpoint_url=args.endpoint_url, region_name=args.region)
    try:
        fetch(s3, args.bucket, args.prefix, Path(args.dest))
    except (ClientError, BotoCoreError, OSError, ValueError) as exc:
        print(f"fetch_model: cannot copy the model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
