"""Artifact store over fsspec: a local folder or s3://bucket/prefix, laid out `<root>/<run>/<stage>/`.

Completion protocol (nanochat and Prefect's big-data guide do the same): a stage writes its outputs,
then `manifest.json` last. A prefix without a manifest is incomplete and readers refuse it. Clearing a
prefix deletes the manifest first, so a crash mid-delete never leaves a manifest over partial data.
Names starting with '_' are reserved for the store itself (`_cache/`, `_attempt.json`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import posixpath
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.core.config import StorageConfig, check_name
from rlhf.core.manifest import Manifest, ManifestError
from rlhf.core.manifest import check as check_manifest
from rlhf.core.net import http_status, shown

MANIFEST = "manifest.json"
ATTEMPT = "_attempt.json"
CHECKPOINTS = "checkpoints"
COMPLETE = ".complete"  # written last into a checkpoint folder: the copy finished


class ArtifactMissing(Exception):
    """A stage's outputs were asked for, but the stage has not completed (no manifest)."""


class SchemaMismatch(Exception):
    pass


class StorageError(RuntimeError):
    """A storage operation kept failing after bounded retries."""


# Not transient: retrying cannot help, and the callers rely on seeing them (a missing manifest is data).
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def retrying(op: str):
    """Retries an ArtifactStore method on transient errors (OSError and connection errors that are not
    PERMANENT), with exponential backoff, then raises StorageError naming the operation and the URL."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, path, *args, **kwargs):
            delay = self.cfg.backoff_seconds
            for attempt in range(1, self.cfg.attempts + 1):
                try:
                    return fn(self, path, *args, **kwargs)
                except PERMANENT:
                    raise
                except (OSError, ConnectionError, TimeoutError) as e:
                    last = e
                except Exception as e:  # botocore/aiohttp connection errors are not OSErrors
                    if not any(k in type(e).__name__ for k in ("Connect", "Timeout", "Endpoint", "ServerDisconnected")):
                        raise
                    last = e
                if attempt < self.cfg.attempts:
                    time.sleep(delay)
                    delay *= 2
                    self.fs.invalidate_cache()
            target = self.url(path if isinstance(path, str) else str(path))
            raise StorageError(f"storage {op} of {target} failed after {self.cfg.attempts} attempts: "
                               f"{type(last).__name__}: {last}") from last

        return inner

    return wrap


def endpoint(cfg: StorageConfig) -> tuple[str | None, str]:
    """The S3 endpoint a store on s3:// talks to, and where that came from (None for a local folder, and
    for AWS itself, whose endpoint botocore derives from the region)."""
    for where, url in (("storage.endpoint_url", cfg.endpoint_url), ("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
                       ("AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL"))):
        if url:
            return url, where
    return None, "storage.region"


def endpoint_problem(cfg: StorageConfig, timeout: float = 3.0) -> str | None:
    """'storage...: ...' when the store's S3 endpoint does not answer HTTP within `timeout` s (any status
    counts as an answer: credentials are checked by the first real request), else None."""
    if not cfg.url.startswith("s3://"):
        return None
    url, where = endpoint(cfg)
    url = url or f"https://s3.{cfg.region}.amazonaws.com"
    _, why = http_status(url, timeout)
    return why and f"storage: no S3 endpoint answers at {shown(url)} (from {where}) within {timeout:g} s ({why})"


def filesystem(cfg: StorageConfig) -> tuple[fsspec.AbstractFileSystem, str]:
    """Returns (fs, root path inside fs). S3 credentials come from the environment only."""
    if cfg.url.startswith("s3://"):
        import s3fs

        fs = s3fs.S3FileSystem(
            endpoint_url=endpoint(cfg)[0],
            client_kwargs={"region_name": cfg.region},
            config_kwargs={"retries": {"max_attempts": 3, "mode": "standard"}},
            use_listings_cache=False,
        )
        return fs, cfg.url.removeprefix("s3://").rstrip("/")
    root = cfg.url.removeprefix("file://")
    return fsspec.filesystem("file"), str(Path(root).expanduser().resolve())


class ArtifactStore:
    def __init__(self, cfg: StorageConfig):
        self.cfg = cfg
        self.fs, self.root = filesystem(cfg)
        self.is_local = not cfg.url.startswith("s3://")

    # ---- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        for p in parts:
            if p.startswith("/") or ".." in p.split("/"):
                raise ValueError(f"refusing path segment {p!r}: absolute or traversing")
        return posixpath.join(self.root, *parts)

    def stage_path(self, run: str, stage: str, *rest: str) -> str:
        check_name("run", run)
        check_name("stage", stage)
        return self.path(run, stage, *rest)

    def url(self, path: str) -> str:
        """A printable location (never carries credentials: those live in the environment)."""
        return f"s3://{path}" if not self.is_local else path

    # ---- manifests ---------------------------------------------------------------------------
    def read_manifest(self, run: str, stage: str) -> Manifest | None:
        """The stage's manifest, None when it has none (incomplete); ManifestError when the file is not one."""
        path = self.stage_path(run, stage, MANIFEST)
        try:
            obj = self.read_json(path)
        except ValueError as e:  # invalid JSON or UTF-8
            raise ManifestError(f"{self.url(path)}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        return None if obj is None else check_manifest(obj, self.url(path))

    def require_manifest(self, run: str, stage: str) -> Manifest:
        m = self.read_manifest(run, stage)
        if m is None:
            raise ArtifactMissing(
                f"{self.url(self.stage_path(run, stage))} has no {MANIFEST}: stage {stage!r} of run {run!r} "
                "has not completed, so its outputs cannot be read"
            )
        return m

    def write_manifest(self, run: str, stage: str, manifest: Manifest) -> None:
        path = self.stage_path(run, stage, MANIFEST)
        # checked in its JSON form, as every reader will see it (a numpy number would be a string there)
        check_manifest(json.loads(json.dumps(manifest, default=str)), self.url(path))
        self.write_json(path, manifest)

    @retrying("write")
    def write_json(self, path: str, obj: Any) -> None:
        """Atomic: local files go through a temp name + rename; an S3 PUT is atomic per object."""
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if self.is_local:
            _write_atomically(path, data)
        else:
            self.fs.pipe_file(path, data)

    @retrying("read")
    def read_json(self, path: str) -> Any | None:
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rb") as f:
            return json.loads(f.read())

    # ---- conditional writes (the run lock) ---------------------------------------------------
    @retrying("create")
    def create_json(self, path: str, obj: Any) -> bool:
        """Writes `obj` at `path` only if nothing is there, atomically; False when something was. Locally
        under an exclusive flock of the folder (see _dir_locked); on S3 a conditional PUT (If-None-Match: *,
        which AWS S3, SeaweedFS and MinIO honour)."""
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if not self.is_local:
            return self._put_if(path, data, IfNoneMatch="*")
        with _dir_locked(path):
            if os.path.exists(path):
                return False
            _write_atomically(path, data)
            return True

    @retrying("read")
    def read_json_tagged(self, path: str) -> tuple[Any | None, str | None]:
        """(the JSON object at `path`, a tag of that version for replace_json), or (None, None). The tag is
        the object's ETag on S3 (read before the body: a body newer than its tag makes the replace fail,
        which is the safe side), a digest of the bytes locally. Anything but a JSON object reads as {}."""
        if not self.fs.exists(path):
            return None, None
        if self.is_local:
            try:
                data = Path(path).read_bytes()
            except FileNotFoundError:  # released between the two calls
                return None, None
            tag = hashlib.sha256(data).hexdigest()
        else:
            tag = self.fs.info(path)["ETag"]
            data = self.fs.cat_file(path)
        try:
            obj = json.loads(data)
        except ValueError:  # invalid JSON or UTF-8: a record nobody can trust
            obj = {}
        return obj if isinstance(obj, dict) else {}, tag

    @retrying("replace")
    def replace_json(self, path: str, obj: Any, tag: str) -> bool:
        """Replaces the version of `path` that read_json_tagged tagged `tag` by `obj`; False when `path`
        holds another version, or none. On S3 a conditional PUT (If-Match); locally compare and write under
        the folder's flock, the new version renamed into place (readers never see the name missing)."""
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        if not self.is_local:
            return self._put_if(path, data, IfMatch=tag)
        with _dir_locked(path):
            try:
                current = Path(path).read_bytes()
            except FileNotFoundError:
                return False
            if hashlib.sha256(current).hexdigest() != tag:
                return False
            _write_atomically(path, data)
            return True

    @retrying("release")
    def remove_if(self, path: str, owner: str) -> bool:
        """Deletes the JSON object at `path` only while its "owner" field is `owner` (the run lock's
        release: a lock taken over in the meantime stays). Locally under the folder's flock; on S3 the
        read and the delete are two requests, so a takeover between them is undone only there."""
        if not self.is_local:
            current = self.read_json(path)
            if isinstance(current, dict) and current.get("owner") == owner:
                self.remove(path)
                return True
            return False
        with _dir_locked(path):
            try:
                current = json.loads(Path(path).read_bytes())
            except (FileNotFoundError, ValueError):
                return False
            if isinstance(current, dict) and current.get("owner") == owner:
                os.unlink(path)
                return True
            return False

    def _put_if(self, path: str, data: bytes, **condition: str) -> bool:
        """A PUT with an S3 precondition; False when the store says it does not hold (HTTP 412, or 409
        for a conditional write racing another)."""
        from botocore.exceptions import ClientError

        bucket, _, key = path.partition("/")
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except OSError as e:  # s3fs turns botocore's ClientError into an OSError, the ClientError its cause
            cause = e.__cause__
            if isinstance(cause, ClientError) and cause.response.get("Error", {}).get("Code") in (
                    "PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        finally:
            self.fs.invalidate_cache(path)
        return True

    @retrying("write")
    def write_bytes(self, path: str, data: bytes) -> None:
        """One small object (a marker, a markdown file); an S3 PUT is atomic per object."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(path, data)

    @retrying("delete")
    def remove(self, path: str) -> None:
        """Deletes a file or a folder; a path that is already gone is fine."""
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    @retrying("list")
    def glob(self, pattern: str) -> list[str]:
        return sorted(self.fs.glob(pattern))

    def clear_stage(self, run: str, stage: str) -> None:
        prefix = self.stage_path(run, stage)
        self.remove(posixpath.join(prefix, MANIFEST))  # first: a half-cleared prefix never looks complete
        self.remove(prefix)
        self.fs.invalidate_cache()

    # ---- tables ------------------------------------------------------------------------------
    @retrying("write")
    def write_table(self, path: str, table: pa.Table, schema: pa.Schema) -> None:
        if not table.schema.equals(schema):
            raise SchemaMismatch(f"{path}: table schema\n{table.schema}\ndoes not match the declared schema\n{schema}")
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        pq.write_table(table, path, filesystem=self.fs)

    @retrying("read")
    def read_table(self, path: str, schema: pa.Schema) -> pa.Table:
        table = pq.read_table(path, filesystem=self.fs)
        if not table.schema.equals(schema, check_metadata=False):
            raise SchemaMismatch(f"{self.url(path)}: stored schema\n{table.schema}\nis not the expected\n{schema}")
        return table

    # ---- folders (checkpoints, model folders) ------------------------------------------------
    def put_dir(self, local: str | Path, remote: str) -> None:
        """Uploads file by file, each retried: a retry never restarts a large folder from scratch."""
        local = Path(local)
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            self._put_file(posixpath.join(remote, file.relative_to(local).as_posix()), file)

    def put_file(self, local: str | Path, remote: str) -> None:
        self._put_file(remote, Path(local))

    @retrying("upload")
    def _put_file(self, dest: str, file: Path) -> None:
        self.fs.makedirs(posixpath.dirname(dest), exist_ok=True)
        self.fs.put_file(str(file), dest)

    @retrying("download")
    def get_dir(self, remote: str, local: str | Path) -> Path:
        local = Path(local)
        remote = remote.rstrip("/")
        for file in self.fs.find(remote):
            rel = posixpath.relpath(file, remote)
            dest = local / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(file, str(dest))
        return local

    @retrying("list")
    def complete_checkpoints(self, run: str, stage: str) -> dict[int, str]:
        """step -> folder name of each checkpoint of the stage whose COMPLETE marker exists. Names end in
        their step or iteration number (`checkpoint-12`, `iter-000003`)."""
        root = self.stage_path(run, stage, CHECKPOINTS)
        return {int(name.rsplit("-", 1)[1]): name for name in self.list_dirs(root)
                if self.fs.exists(posixpath.join(root, name, COMPLETE))}

    @retrying("list")
    def list_dirs(self, path: str) -> list[str]:
        if not self.fs.exists(path):
            return []
        return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False) if self.fs.isdir(p)]


@contextlib.contextmanager
def _dir_locked(path: str):
    """An exclusive flock of the folder holding `path`, for a compare-and-write on the local disk. A
    rename-aside protocol left the name missing for a moment, and a create in that moment won beside the
    replace (two winners of one takeover). flock on a folder's descriptor works on Linux and macOS
    filesystems and leaves no file behind; it binds processes of one host, which is what a local store
    is shared by."""
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


def _write_atomically(path: str, data: bytes) -> None:
    """A complete, fsynced temp file renamed over `path`: readers see the old version or the new one."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
