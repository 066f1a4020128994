"""Artifact store against a local folder and a real SeaweedFS S3 server on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from rlhf.config import StorageConfig
from rlhf.store import ArtifactMissing, ArtifactStore, SchemaMismatch

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("text", pa.string())])


def test_manifest_table_and_folder_roundtrip(storage_url, tmp_path):
    store = ArtifactStore(StorageConfig(url=storage_url))
    assert store.read_manifest("r1", "sft") is None
    table = pa.Table.from_pylist([{"id": 1, "text": "a"}, {"id": 2, "text": None}], schema=SCHEMA)
    store.write_table(store.stage_path("r1", "sft", "t.parquet"), table, SCHEMA)
    assert store.read_table(store.stage_path("r1", "sft", "t.parquet"), SCHEMA).to_pylist() == table.to_pylist()

    src = tmp_path / "folder"
    (src / "sub").mkdir(parents=True)
    (src / "a.json").write_text("{}")
    (src / "sub" / "b.bin").write_bytes(b"\x00\x01")
    store.put_dir(src, store.stage_path("r1", "sft", "model"))
    back = store.get_dir(store.stage_path("r1", "sft", "model"), tmp_path / "back")
    assert (back / "sub" / "b.bin").read_bytes() == b"\x00\x01" and (back / "a.json").read_text() == "{}"

    store.write_manifest("r1", "sft", {"key": "k1", "rows": {"train": 2}})
    assert store.require_manifest("r1", "sft")["key"] == "k1"
    store.clear_stage("r1", "sft")
    assert store.read_manifest("r1", "sft") is None
    assert not store.fs.exists(store.stage_path("r1", "sft", "t.parquet"))


def test_schema_is_enforced_on_write_and_read(storage_url):
    store = ArtifactStore(StorageConfig(url=storage_url))
    wrong = pa.table({"id": pa.array([1], pa.int32()), "text": ["x"]})
    with pytest.raises(SchemaMismatch):
        store.write_table(store.stage_path("r", "s", "t.parquet"), wrong, SCHEMA)
    other = pa.schema([pa.field("id", pa.int64())])
    store.write_table(store.stage_path("r", "s", "u.parquet"), pa.table({"id": [1]}), other)
    with pytest.raises(SchemaMismatch):
        store.read_table(store.stage_path("r", "s", "u.parquet"), SCHEMA)


def test_reader_refuses_prefix_without_manifest(storage_url):
    store = ArtifactStore(StorageConfig(url=storage_url))
    store.write_json(store.stage_path("r", "sft", "partial.json"), {"x": 1})
    with pytest.raises(ArtifactMissing, match="has no manifest.json"):
        store.require_manifest("r", "sft")


@pytest.mark.parametrize("name", ["..", "../x", "/abs", "a/b", "", "_cache", ".hidden", "a..b", "x" * 65])
def test_traversal_and_unsafe_names_are_refused(tmp_path, name):
    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    with pytest.raises(ValueError, match="invalid"):
        store.stage_path(name, "sft")
    with pytest.raises(ValueError, match="invalid"):
        store.stage_path("run", name)


def test_path_refuses_traversing_segments(tmp_path):
    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    with pytest.raises(ValueError, match="traversing"):
        store.path("run", "../../etc")


def test_writer_killed_between_data_and_manifest_leaves_an_absent_stage(storage_url, tmp_path):
    """A real process writes data, then dies by SIGKILL before its manifest: readers see nothing."""
    script = textwrap.dedent(
        f"""
        import os, signal
        import pyarrow as pa
        from rlhf.config import StorageConfig
        from rlhf.store import ArtifactStore
        store = ArtifactStore(StorageConfig(url={storage_url!r}))
        schema = pa.schema([pa.field("id", pa.int64())])
        store.write_table(store.stage_path("r", "sft", "data.parquet"), pa.table({{"id": [1, 2]}}, schema=schema), schema)
        os.kill(os.getpid(), signal.SIGKILL)
        store.write_manifest("r", "sft", {{"key": "never"}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    store = ArtifactStore(StorageConfig(url=storage_url))
    assert store.fs.exists(store.stage_path("r", "sft", "data.parquet"))  # the data did land...
    assert store.read_manifest("r", "sft") is None  # ...but the stage is absent
    with pytest.raises(ArtifactMissing):
        store.require_manifest("r", "sft")


def test_local_manifest_write_is_atomic(tmp_path):
    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    store.write_manifest("r", "sft", {"key": "a"})
    leftovers = [p.name for p in (tmp_path / "r" / "sft").iterdir()]
    assert leftovers == ["manifest.json"]


def test_s3_credentials_never_reach_the_printable_url(s3_env):
    store = ArtifactStore(StorageConfig(url=s3_env["url"]))
    shown = store.url(store.stage_path("r", "sft"))
    assert shown == f"{s3_env['url']}/r/sft" and "test" not in shown.replace(s3_env["bucket"], "")


def test_storage_outage_fails_bounded_with_url_then_recovers(tmp_path, monkeypatch):
    """A real SeaweedFS is stopped mid-use: operations fail after the configured attempts with a message
    naming the URL (no credentials), quickly; once it is back, the same store reads what was committed."""
    from conftest import start_weed, stop_weed, weed_ports
    from rlhf.store import StorageError

    ports = weed_ports()
    proc, client = start_weed(tmp_path, ports)
    try:
        client.create_bucket(Bucket="outage", CreateBucketConfiguration={"LocationConstraint": "us-west-1"})
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
        cfg = StorageConfig(url="s3://outage/rlhf", endpoint_url=f"http://127.0.0.1:{ports['s3']}", attempts=3, backoff_seconds=0.2)
        store = ArtifactStore(cfg)
        store.write_manifest("r", "sft", {"key": "k1"})
        stop_weed(proc)

        t0 = time.perf_counter()
        with pytest.raises(StorageError) as e:
            store.write_json(store.stage_path("r", "sft", "x.json"), {"a": 1})
        elapsed = time.perf_counter() - t0
        msg = str(e.value)
        assert "storage write of s3://outage/rlhf/r/sft/x.json failed after 3 attempts" in msg
        assert "s3cr3t" not in msg and elapsed < 60
        with pytest.raises(StorageError, match="storage read of s3://outage/rlhf/r/sft/manifest.json"):
            store.read_manifest("r", "sft")

        proc, client = start_weed(tmp_path, ports)  # same data folder: what was committed is still there
        assert ArtifactStore(cfg).read_manifest("r", "sft") == {"key": "k1"}
    finally:
        stop_weed(proc)
