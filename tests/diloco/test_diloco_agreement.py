"""Replicas of one object-store run agree, or are refused (issue 40), through ``composer-plugins diloco`` on a
``file://`` store as a user runs it:

* a replica paused past a round it published, which the others closed with it, applied and then collected
  (``keep_rounds``), never writes a partial mean of that round: it takes the newest state and ends on the others'
  weights;
* ``run.json`` pins the outer optimizer (class and hyper-parameters) and the inner one a replica joining before
  round 0 would take: a replica with another setting is refused, naming it;
* a fresh run on a prefix whose ``run.json`` is gone never adopts the old run's states: refused, naming the object.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from serverless_support import HERE, WAIT_S, cli, finish, logs, records, result, store_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def _objstore(url: str) -> tuple[str, ...]:
    return ("-S", "diloco.transport=object_store", "-S", f"diloco.store={url}")


def _store_dir(url: str) -> Path:
    return Path(url.removeprefix("file://"))


def test_paused_replica_never_writes_a_partial_mean_of_a_collected_round(tmp_path):
    """Replica 1 stops (SIGSTOP) right after publishing round 2 of 4; replica 0 closes round 2 with both, closes
    round 3 alone, finishes and collects round 2's pseudo-gradients and mean (``keep_rounds: 2``). Woken, replica 1
    finds replica 0's slice gone: it takes state 3 instead of a mean of its own update alone."""
    url = store_url("file", tmp_path, "pause")
    log_dir, fault = tmp_path / "logs", tmp_path / "fault"
    fault.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "PAUSE_REPLICA": "1",
        "PAUSE_ROUND": "2",
        "FAULT_DIR": str(fault),
    }
    proc = cli(
        tmp_path,
        "logs",
        "toy.max_steps=32",
        *_objstore(url),
        "-S",
        "diloco.round_timeout_s=2",
        env=env,
        target="store_fault_target:run",
    )
    paused = fault / "paused-1"
    try:
        deadline = time.monotonic() + WAIT_S
        while not (paused.exists() and (log_dir / "result0.json").exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"replica 1 never paused or replica 0 never finished\n{logs(log_dir)}")
            time.sleep(0.05)
        round2 = sorted(p.name for p in (_store_dir(url) / "rounds" / "00000002").iterdir())
        assert round2 == ["manifest.json"], round2  # the round's pseudo-gradients and mean were collected
        os.kill(int(paused.read_text()), signal.SIGCONT)
        finish(proc, log_dir)
    finally:
        if paused.exists():
            try:
                os.kill(int(paused.read_text()), signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    a, b = result(log_dir, 0), result(log_dir, 1)
    assert a["param_hash"] == b["param_hash"], (a, b)
    assert a["outer_step"] == b["outer_step"] == 32 // 8
    r0 = {r["round"]: r for r in records(log_dir, 0)}
    assert r0[2]["participants"] == 2 and r0[3]["participants"] == 1, r0
    woke = [r for r in records(log_dir, 1) if r["round"] == 2]
    assert len(woke) == 1 and not woke[0]["committed"] and woke[0]["healed"], woke
    assert woke[0]["param_hash"] == r0[3]["param_hash"]
    assert not list((_store_dir(url) / "rounds" / "00000002").glob("mean-*")), "a partial mean was written"
    assert "not making a partial mean" in logs(log_dir)


_PIN = ("--total-replicas", "2", "--run-id", "pin", "toy.max_steps=16", "-S", "diloco.round_timeout_s=1")


@pytest.fixture(scope="module")
def pinned_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose run ``pin`` replica 0 started and finished: ``run.json`` pins its optimizers (one run for
    every case below; each case refuses on a copy of it)."""
    tmp_path = tmp_path_factory.mktemp("pinned")
    url = store_url("file", tmp_path, "pin")
    finish(cli(tmp_path, "a", "--first-index", "0", *_PIN, *_objstore(url), replicas=1), tmp_path / "a")
    return _store_dir(url)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("diloco.outer_lr=0.3", "outer_optimizer.lr is 0.7 in the run, 0.3 here"),
        ("diloco.outer_momentum=0.5", "outer_optimizer.momentum is 0.9 in the run, 0.5 here"),
        ("diloco.outer_nesterov=false", "outer_optimizer.nesterov is True in the run, False here"),
        (
            "diloco.outer_optimizer={class_path: torch.optim.Adam, init_args: {lr: 0.7}}",
            "outer_optimizer.class is 'torch.optim.sgd.SGD' in the run, 'torch.optim.adam.Adam' here",
        ),
        ("toy.lr=0.001", "inner_optimizer.lr is 0.003 in the run, 0.001 here"),
    ],
)
def test_replica_with_another_optimizer_setting_is_refused_naming_it(tmp_path, pinned_store, override, named):
    url = store_url("file", tmp_path, "pin")
    shutil.copytree(pinned_store, _store_dir(url))
    second = cli(tmp_path, "b", "--first-index", "1", *_PIN, *_objstore(url), "-S", override, replicas=1)
    finish(second, tmp_path / "b", rc=1)
    text = logs(tmp_path / "b")
    assert named in text and "run.json" in text and "differ" in text, text
    assert not (tmp_path / "b" / "result1.json").exists() and not records(tmp_path / "b", 1)
    # the same replica with the run's own settings joins the copied run (so the refusal above is the override's)
    if override.startswith("toy."):
        again = cli(tmp_path, "c", "--first-index", "1", *_PIN, *_objstore(url), replicas=1)
        finish(again, tmp_path / "c")


def test_fresh_run_never_adopts_states_of_a_run_whose_run_json_is_gone(tmp_path):
    url = store_url("file", tmp_path, "orphan")
    old = cli(tmp_path, "a", "toy.max_steps=16", "--run-id", "old-run", *_objstore(url))
    finish(old, tmp_path / "a")
    store = _store_dir(url)
    assert sorted(p.name for p in (store / "state").iterdir())
    (store / "run.json").unlink()  # a lifecycle rule that deletes the oldest object first
    fresh = cli(tmp_path, "b", "toy.max_steps=16", *_objstore(url))
    finish(fresh, tmp_path / "b", rc=1)
    text = logs(tmp_path / "b")
    assert "belongs to run 'old-run'" in text and "refused" in text and "fresh prefix" in text, text
    assert not (tmp_path / "b" / "result0.json").exists() and not records(tmp_path / "b", 0)
    assert not (store / "run.json").exists()  # the prefix is left as it was found
    # the old run's own id still continues it (its run.json is claimed again and its states are its own)
    again = cli(tmp_path, "c", "toy.max_steps=32", "--run-id", "old-run", *_objstore(url))
    finish(again, tmp_path / "c")
    a, b = result(tmp_path / "c", 0), result(tmp_path / "c", 1)
    assert a["param_hash"] == b["param_hash"] and a["outer_step"] == 4
    assert min(r["round"] for r in records(tmp_path / "c", 0)) == 2  # it went on from state 1, not round 0


def test_a_run_whose_run_json_was_lost_with_only_pseudo_gradients_left_continues_and_another_is_refused(tmp_path):
    """In-process: a round holding only pseudo-gradients (their slices carry no run id; their index does) is
    this run's own when the index says so, and another run's otherwise."""
    import torch

    from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
    from composer_plugins.diloco.objstore import ForeignObjectError, ObjectStoreDiLoCoCallback, encode_slices

    url = f"file://{tmp_path}/lost"

    def attach(run_id: str) -> ObjectStoreDiLoCoCallback:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        cb = ObjectStoreDiLoCoCallback(
            DiLoCoConfig(transport="object_store", store=url, sync_every=2),
            ReplicaInfo(index=0, num_replicas=2, run_id=run_id),
        )
        return cb.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))

    cb = attach("mine")
    assert cb.rounds is not None and cb.store is not None
    parts, _ = encode_slices(torch.randn(36), "none", 2)
    cb.rounds.put_grad(0, 0, 0, parts)
    cb.close()
    cb.store.delete("run.json")
    attach("mine").close()  # its own objects: it continues (and claims run.json again)
    assert cb.store.exists("run.json")
    cb.store.delete("run.json")
    with pytest.raises(ForeignObjectError, match=r"rounds/00000000/grad-0-0 .*belongs to run 'mine'"):
        attach("other")
    assert not cb.store.exists("run.json")
