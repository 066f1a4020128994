"""Artifact store against a local folder and a real SeaweedFS S3 server on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from rlhf.core.config import StorageConfig
from rlhf.core.store import ArtifactMissing, ArtifactStore, SchemaMismatch

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("text", pa.string())])
# a minimal valid manifest (rlhf/core/manifest.py)
GOOD = {"schema_version": 1, "run": "r", "stage": "sft", "key": "ab" * 32, "inputs": {}, "outputs": {"model": "model"},
        "rows": {"train": 3}, "metrics": {"sft/loss": 0.5}, "resumed_from_step": None}


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

    store.write_manifest("r1", "sft", {**GOOD, "run": "r1", "key": "1a" * 32})
    assert store.require_manifest("r1", "sft")["key"] == "1a" * 32
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
        from rlhf.core.config import StorageConfig
        from rlhf.core.store import ArtifactStore
        store = ArtifactStore(StorageConfig(url={storage_url!r}))
        schema = pa.schema([pa.field("id", pa.int64())])
        store.write_table(store.stage_path("r", "sft", "data.parquet"), pa.table({{"id": [1, 2]}}, schema=schema), schema)
        os.kill(os.getpid(), signal.SIGKILL)
        store.write_manifest("r", "sft", {GOOD!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    store = ArtifactStore(StorageConfig(url=storage_url))
    assert store.fs.exists(store.stage_path("r", "sft", "data.parquet"))  # the data did land...
    assert store.read_manifest("r", "sft") is None  # ...but the stage is absent
    with pytest.raises(ArtifactMissing):
        store.require_manifest("r", "sft")


def test_local_manifest_write_is_atomic(tmp_path, monkeypatch):
    """A write that dies before its rename (a killed worker) leaves the previous manifest whole, and a
    stage that had none still has none: a reader never sees a half-written manifest."""
    import rlhf.core.store

    store = ArtifactStore(StorageConfig(url=str(tmp_path), attempts=1))
    store.write_manifest("r", "sft", {**GOOD, "key": "a" * 64})
    assert [p.name for p in (tmp_path / "r" / "sft").iterdir()] == ["manifest.json"]

    def killed(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(rlhf.core.store.os, "replace", killed)
    with pytest.raises(Exception, match="killed before the rename"):
        store.write_manifest("r", "sft", {**GOOD, "key": "b" * 64, "metrics": {f"m{i}": 0.5 for i in range(1000)}})
    with pytest.raises(Exception, match="killed before the rename"):
        store.write_manifest("r", "dpo", {**GOOD, "key": "c" * 64})
    assert store.read_manifest("r", "sft") == {**GOOD, "key": "a" * 64}
    assert store.read_manifest("r", "dpo") is None


def test_s3_credentials_never_reach_the_printable_url(s3_env):
    store = ArtifactStore(StorageConfig(url=s3_env["url"]))
    shown = store.url(store.stage_path("r", "sft"))
    assert shown == f"{s3_env['url']}/r/sft" and "test" not in shown.replace(s3_env["bucket"], "")


@pytest.mark.slow
def test_storage_outage_mid_stage_fails_bounded_then_rerun_resumes(tiny_cfg, tmp_path, monkeypatch):
    """A real SeaweedFS is stopped while SFT trains on it, right after its first checkpoint is committed:
    the stage fails within the configured attempts with a message naming the stage and the URL (no
    credentials), leaves no manifest; once SeaweedFS is back, the rerun resumes from that checkpoint."""
    import threading

    from conftest import only, start_weed, stop_weed, weed_ports
    from rlhf.pipeline.runner import execute_stage
    from rlhf.core.store import StorageError

    ports = weed_ports()
    (tmp_path / "weed").mkdir()
    proc, client = start_weed(tmp_path / "weed", ports)
    try:
        client.create_bucket(Bucket="outage", CreateBucketConfiguration={"LocationConstraint": "us-west-1"})
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
        cfg = tiny_cfg(*only("sft"), "sft.max_steps=16", "sft.save_steps=4", "sft.eval_prompts=0", "storage.attempts=3",
                       "storage.backoff_seconds=0.2", f"storage.endpoint_url=http://127.0.0.1:{ports['s3']}",
                       storage="s3://outage/rlhf")
        outcome: dict = {}

        def train() -> None:
            try:
                outcome["manifest"] = execute_stage(cfg, "sft")
            except Exception as e:  # noqa: BLE001 - the test inspects it
                outcome["error"] = e

        worker = threading.Thread(target=train)
        worker.start()
        deadline = time.time() + 300
        while not any(o["Key"].endswith("/.complete") for o in
                      client.list_objects_v2(Bucket="outage", Prefix="rlhf/tiny/sft/checkpoints/").get("Contents", [])):
            assert time.time() < deadline and worker.is_alive(), "no SFT checkpoint was committed"
            time.sleep(0.2)
        stop_weed(proc)
        t0 = time.perf_counter()
        worker.join(timeout=300)
        elapsed = time.perf_counter() - t0
        err = outcome.get("error")
        assert isinstance(err, StorageError), outcome
        msg = str(err)
        assert msg.startswith("stage 'sft' of run 'tiny': storage ") and "s3://outage/rlhf/tiny/sft/" in msg
        assert "failed after 3 attempts" in msg and "s3cr3t" not in msg and elapsed < 60

        proc, client = start_weed(tmp_path / "weed", ports)  # same data folder: what was committed is still there
        store = ArtifactStore(cfg.storage)
        assert store.read_manifest("tiny", "sft") is None  # the failed attempt never looks complete
        m = execute_stage(cfg, "sft")
        assert m["status"] == "resumed" and m["resumed_from_step"] in (4, 8, 12)
        assert store.require_manifest("tiny", "sft")["key"] == m["key"]
    finally:
        stop_weed(proc, graceful=False)


@pytest.mark.parametrize("call", ["write_bytes", "remove", "glob", "list_dirs", "put_file"])
def test_every_stage_write_path_retries_a_transient_error_then_names_the_url(tmp_path, monkeypatch, call):
    """The checkpoint marker, pruning, eval's files and listings go through retried store methods: one
    transient OSError (S3's 'internal error' as s3fs raises it) is retried; a lasting one ends in a
    StorageError naming the URL after storage.attempts tries (the CI flake of 2026-12-01 was a raw
    OSError from an unretried fs.pipe_file)."""
    from rlhf.core.store import StorageError

    store = ArtifactStore(StorageConfig(url=str(tmp_path / "s"), attempts=3, backoff_seconds=0.0))
    (tmp_path / "local.txt").write_text("x")
    path = store.path("r", "sft", "checkpoints", "checkpoint-4", ".complete")
    args = {"write_bytes": (path, b"ok"), "remove": (path,), "glob": (store.path("r", "*"),),
            "list_dirs": (store.path("r"),), "put_file": (tmp_path / "local.txt", path)}[call]
    real, failures = store.fs.exists, {"left": 1}

    def flaky(p, *a, **kw):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(121, "We encountered an internal error, please try again.")
        return real(p, *a, **kw)

    store.fs.mkdirs(store.path("r"), exist_ok=True)
    monkeypatch.setattr(store.fs, "exists", flaky)
    monkeypatch.setattr(store.fs, "glob", lambda p, *a, **kw: (flaky(p), [])[1])
    monkeypatch.setattr(store.fs, "makedirs", lambda p, *a, **kw: (flaky(p), os.makedirs(p, exist_ok=True))[1])
    getattr(store, call)(*args)  # one failure, then success
    assert failures["left"] == 0
    failures["left"] = 99
    with pytest.raises(StorageError, match=r"failed after 3 attempts: OSError: .*internal error") as e:
        getattr(store, call)(*args)
    assert str(tmp_path / "s") in str(e.value)



@pytest.mark.parametrize("change, named", [
    ({"outputs": ["model"]}, "'outputs' must be a mapping of names to relative paths"),
    ({"metrics": {"sft/loss": "0.5"}}, "'metrics' must be a mapping of names to numbers"),
    ({"rows": {"train": True}}, "'rows' must be a mapping of names to integers"),
    ({"key": "../../etc"}, "'key' must be a hex content key"),
    ({"inputs": {"sft": 7}}, "'inputs' must be a mapping of stage names to hex content keys"),
    ({"schema_version": 2}, "'schema_version' must be the number 1"),
    ({"resumed_from_step": "4"}, "'resumed_from_step' must be an integer or null"),
    ({"inputs": None, "outputs": None}, "'inputs' must be"),
])
def test_manifest_check_names_the_file_and_every_wrong_field(change, named):
    from rlhf.core.manifest import ManifestError, check

    assert check(dict(GOOD), "m.json") == GOOD
    check({**GOOD, "metrics": {"sft/accuracy": float("nan")}}, "m.json")  # a metric with nothing to measure
    with pytest.raises(ManifestError, match=r"^m\.json: invalid manifest: .*" + named.replace("(", r"\(")):
        check({**GOOD, **change}, "m.json")
    with pytest.raises(ManifestError, match="'key' is missing; 'rows' is missing"):
        check({k: v for k, v in GOOD.items() if k not in ("key", "rows")}, "m.json")
    with pytest.raises(ManifestError, match="not a manifest"):
        check([GOOD], "m.json")


def test_an_invalid_stored_manifest_reruns_its_stage_and_stops_a_downstream_one(tiny_cfg):
    """A manifest that is not one (hostile, truncated, another version's) is never trusted: its own stage
    runs again (preflight says so), a stage reading it as an input fails naming the file."""
    from conftest import only
    from rlhf.core.manifest import ManifestError
    from rlhf.pipeline.preflight import outlook
    from rlhf.pipeline.runner import execute_stage

    cfg = tiny_cfg(*only("sft", "ref_logprobs"), "preferences.enabled=false")
    store = ArtifactStore(cfg.storage)
    first = execute_stage(cfg, "sft")
    path = store.stage_path("tiny", "sft", "manifest.json")
    store.write_bytes(path, b'{"key": 5, "outputs": []')  # truncated JSON
    with pytest.raises(ManifestError, match=r"sft/manifest\.json: not valid JSON"):
        execute_stage(cfg, "ref_logprobs")
    store.write_json(path, {**first, "outputs": ["model"]})
    with pytest.raises(ManifestError, match=r"sft/manifest\.json: invalid manifest: 'outputs' must be"):
        execute_stage(cfg, "ref_logprobs")
    assert outlook(cfg, store)["sft"].startswith("run (the stored manifest is invalid and will be replaced")
    again = execute_stage(cfg, "sft")
    assert again["status"] != "skipped" and again["key"] == first["key"]
    assert execute_stage(cfg, "ref_logprobs")["inputs"] == {"sft": first["key"]}
