"""Experiment tracking (scheduler/tracking.py) against the libraries' own local modes: an
MLflow file store and a Weights & Biases offline run in a temporary directory. The sink gets the
records the scheduler writes (RunLog.record, then summary.json and RunLog.close, as
Coordinator.close does); what was logged is read back with MLflow's client and W&B's own record
type, and checked value by value. Each test skips when its library is not installed
(`pip install 'hetps[mlflow]'` / `'hetps[wandb]'`)."""

from __future__ import annotations

import json
import struct

import pytest
from cluster_util import wait_for

from hetps.runconfig.load import load_config
from hetps.scheduler.runlog import RunLog
from hetps.scheduler.tracking import TrackingSink, missing

# an eval row as Coordinator._record_eval writes it: a language model's metrics (no accuracy)
EVALS = [
    {"t": 1.0 * i, "global_steps": 10 * (i + 1), "global_samples": 320 * (i + 1),
     "perplexity": 9.0 - i, "loss": 2.2 - 0.1 * i, "watch": "perplexity",
     "higher_is_better": False, "final": False}
    for i in range(3)
]  # fmt: skip
SUMMARY = {"global_steps": 30, "best_perplexity": 7.0, "elapsed_s": 2.5, "stop_reason": "x"}


def mirror_a_run(cfg, run_dir) -> None:
    """What the scheduler does over a run: records, then summary.json, then close."""
    runlog = RunLog(run_dir)
    runlog.sink = TrackingSink(cfg, "abc123", run_dir)
    runlog.record("register", t=0.1, node="worker0", host="h")
    runlog.record("step", t=0.5, worker=0, step=1, loss=2.3)
    for row in EVALS:
        runlog.record("eval", **row)
    runlog.write_summary(SUMMARY)
    runlog.close()


def test_mlflow_file_store_holds_params_every_eval_metric_and_the_summary(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store, for a test: no server
    uri = f"file://{tmp_path}/mlruns"
    cfg = load_config(
        None,
        [f"tracking.mlflow.tracking_uri={uri}", "tracking.mlflow.experiment=drift", "name=lm"],
    )
    (tmp_path / "run").mkdir()
    mirror_a_run(cfg, tmp_path / "run")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("drift").experiment_id])
    assert run.info.run_name == "lm-abc123" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["optimizer.lr"] == str(cfg.optimizer.lr) and params["name"] == "lm"
    workers = json.loads(params["cluster.workers"])  # a list: its JSON text
    assert [w["slowdown"] for w in workers] == [w.slowdown for w in cfg.cluster.workers]
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in ("eval/perplexity", "eval/loss", "global_samples", "t")
    }
    assert history["eval/perplexity"] == [(10, 9.0), (20, 8.0), (30, 7.0)]
    assert [v for _, v in history["eval/loss"]] == pytest.approx([2.2, 2.1, 2.0])
    assert history["global_samples"] == [(10, 320.0), (20, 640.0), (30, 960.0)]
    assert "eval/accuracy" not in run.data.metrics and "eval/final" not in run.data.metrics
    assert run.data.metrics["summary/best_perplexity"] == 7.0
    assert run.data.metrics["summary/elapsed_s"] == 2.5
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert artifacts == ["summary.json"]


def wandb_records(path) -> list:
    """The records of a W&B run file (`run-ID.wandb`), as W&B's own protobuf Record: the file is
    a 7-byte header (`:W&B`, magic, version) then LevelDB-log framing (32 KiB blocks; each chunk
    a CRC, a length and a type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def items(entries) -> dict:
    """W&B's key/value entries (a key with a `/` may come as its parts: nested_key)."""
    return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}


def test_wandb_offline_run_holds_config_every_eval_metric_and_the_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, ["tracking.wandb.project=hetps-test", "tracking.wandb.mode=offline"])
    mirror_a_run(cfg, run_dir)
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # tracking.wandb.dir "": RUN_DIR
    # W&B's service process writes the file: the run's `exit` record closes it
    records = wait_for(
        lambda: (
            (recs := wandb_records(path)) and recs[-1].WhichOneof("record_type") == "exit" and recs
        ),
        60,
        "the offline run's exit record",
    )
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds.count("run") == 1, kinds
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "default-abc123" and run.project == "hetps-test"
    config = items(run.config.update)
    assert config["optimizer"]["lr"] == cfg.optimizer.lr, config["optimizer"]
    rows = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [(r["global_steps"], r["eval/perplexity"]) for r in rows] == [
        (10, 9),
        (20, 8),
        (30, 7),
    ], rows
    assert [r["global_samples"] for r in rows] == [320, 640, 960]
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(items(r.summary.update))
    assert summary["summary/best_perplexity"] == 7.0 and summary["summary/global_steps"] == 30


def test_tracking_configured_without_its_library_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb raises ImportError
    cfg = load_config(None, ["tracking.wandb.project=p"])
    problem = missing(cfg)
    assert problem is not None and problem.startswith("tracking.wandb needs the wandb package")
    assert "pip install 'hetps[wandb]'" in problem
    assert missing(load_config(None, [])) is None  # off by default: nothing needed
