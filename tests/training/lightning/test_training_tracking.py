"""MLflow runs as a user finds them in the store: names that say what a run is, provenance tags, artifacts
kept with the store (not in ./mlruns of wherever the command ran). Read back from a real sqlite store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from composer_plugins.training.lightning import tracking
from composer_plugins.training.runs.run import run_train

pytestmark = pytest.mark.slow


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "COMPOSER_MLFLOW", "DVC_EXP_NAME", "DVC_STAGE"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "store").mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the command runs in a directory unrelated to the store
    return f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"


def _train(make_cfg, tmp_path: Path, uri: str, out: str, *extra: str):
    cfg, src = make_cfg(
        f'mlflow: {{enabled: true, tracking_uri: "{uri}", experiment: names, log_checkpoints: false}}\n',
        "trainer.max_steps=1",
        "trainer.checkpoint_every_n_steps=0",
        "losses.hint_distill.enabled=false",
        *extra,
        out=tmp_path / out,
    )
    return run_train(cfg, src)


def test_runs_are_named_by_what_they_are_and_tagged_with_provenance(make_cfg, tmp_path, store, monkeypatch):
    import mlflow

    a = _train(make_cfg, tmp_path, store, "lr-small")
    b = _train(make_cfg, tmp_path, store, "lr-small", "seed=1")
    monkeypatch.setenv("DVC_EXP_NAME", "bold-lr")
    c = _train(make_cfg, tmp_path, store, "lr-small")
    monkeypatch.delenv("DVC_EXP_NAME")
    d = _train(make_cfg, tmp_path, store, "mine", "mlflow.run_name=my-ablation")
    client = mlflow.MlflowClient(store)
    names = [client.get_run(r.run_id).info.run_name for r in (a, b, c, d)]
    assert names == [
        "train@lr-small-s0 (grpo)",
        "train@lr-small-s1 (grpo)",
        "train@lr-small-s0 (grpo) [bold-lr]",  # a dvc exp's run is told apart from the baseline's
        "my-ablation",  # a user-given name is kept as given
    ]
    tags = client.get_run(a.run_id).data.tags
    from composer_plugins import __version__

    assert tags["plugin.losses.grpo"] == f"grpo (composer-plugins {__version__})"
    assert tags["plugin.env"] == f"gsm8k (composer-plugins {__version__})"
    assert "plugin.losses.hint_distill" not in tags  # off: not a component of this run
    assert tags["composer_plugins.version"] == __version__
    assert tags["git.commit"] == tracking.git_commit()[0] == tags["mlflow.source.git.commit"]
    assert client.get_run(c.run_id).data.tags["dvc.exp"] == "bold-lr"


def test_artifacts_are_kept_with_the_store(make_cfg, tmp_path, store):
    import mlflow

    res = _train(make_cfg, tmp_path, store, "art")
    client = mlflow.MlflowClient(store)
    run = client.get_run(res.run_id)
    assert run.info.artifact_uri.startswith((tmp_path / "store" / "mlartifacts").as_uri())
    assert {"model", "history.csv"} <= {a.path for a in client.list_artifacts(res.run_id)}
    assert (tmp_path / "store" / "mlartifacts").is_dir()
    assert not (tmp_path / "cwd" / "mlruns").exists()


def test_artifact_location_follows_the_store(tmp_path):
    assert tracking.artifact_location(f"sqlite:///{tmp_path}/x/m.db") == (tmp_path / "x" / "mlartifacts").as_uri()
    assert tracking.artifact_location("http://127.0.0.1:5000") is None
    assert tracking.artifact_location(f"file://{tmp_path}/mlruns") is None


@pytest.mark.slow
def test_a_loopback_mlflow_server_gets_the_names_tags_and_artifacts(make_cfg, tmp_path, store):
    """``tracking_uri: http://...``: the run lands on the server, artifacts where the server keeps them."""
    import socket
    import sys
    import time
    import urllib.request

    import mlflow

    from composer_plugins import procs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served = tmp_path / "served"
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    db = f"sqlite:///{tmp_path / 'server.db'}"
    argv = [
        str(mlflow_bin),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        db,
        "--artifacts-destination",
        str(served),
    ]
    with procs.Children("mlflow-server") as group:
        child = group.start("mlflow server", argv, log_path=tmp_path / "server.log")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert child.proc.poll() is None, child.tail()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"mlflow server did not answer in 120 s:\n{child.tail()}"
            time.sleep(0.5)
        res = _train(make_cfg, tmp_path, url, "served-run")
        client = mlflow.MlflowClient(url)
        run = client.get_run(res.run_id)
        assert run.info.run_name == "train@served-run-s0 (grpo)"
        assert run.data.tags["plugin.losses.grpo"].startswith("grpo (composer-plugins ")
        assert {"model", "history.csv"} <= {a.path for a in client.list_artifacts(res.run_id)}
    assert list(served.rglob("history.csv"))  # the server's artifact store holds them
    assert not (tmp_path / "cwd" / "mlruns").exists()


def _open_store_and_experiment(uri: str, barrier: Any, out: Any) -> None:
    from composer_plugins.training.lightning import tracking

    barrier.wait(timeout=60)
    try:
        client = tracking.client(uri)
        out.put(("ok", tracking.ensure_experiment(client, "cells", uri)))
    except Exception as exc:  # reported to the parent, which fails the test with it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def test_cells_started_together_on_a_fresh_sqlite_store_share_one_schema_and_experiment(tmp_path):
    """Three processes open a store that does not exist yet and create one experiment at once.

    Without the store lock MLflow's schema migration races (``duplicate column name: step``, seen with
    two study cells started together) and the experiment is created twice (``RESOURCE_ALREADY_EXISTS``).
    """
    import multiprocessing as mp

    uri = f"sqlite:///{(tmp_path / 'mlflow.db').as_posix()}"
    ctx = mp.get_context("fork")  # the children only touch sqlite and mlflow
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_open_store_and_experiment, args=(uri, barrier, out)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [r for r in results if r[0] == "error"] == []
    assert len({r[1] for r in results}) == 1  # one experiment, the same id everywhere
    assert (tmp_path / "mlflow.db.lock").exists()
