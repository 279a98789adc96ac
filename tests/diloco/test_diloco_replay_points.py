"""Replay points (``diloco.exact_every``): one due global state in ``exact_every`` is written, the states between
are rebuilt from the rounds' kept means; training does not change, a restart between written states ends on the
others' hash, and the sync log splits what a replica writes by kind (``bytes_by_kind``)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from composer_plugins.core.errors import ConfigError
from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback
from composer_plugins.diloco.objstore.rounds import RoundStore
from composer_plugins.diloco.objstore.statehash import flatten, state_hash
from composer_plugins.diloco.store import CorruptObjectError, ObjectStore, pack, unpack

pytestmark = pytest.mark.slow

H_IN, D_IN, D_HID = 2, 16, 128


def _model(i: int) -> torch.nn.Module:
    torch.manual_seed(i)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.Tanh(), torch.nn.Linear(D_HID, 4))


def _config(url: str, rounds: int, **cfg) -> DiLoCoConfig:
    base = dict(transport="object_store", store=url, run_id="deltas", sync_every=H_IN, outer_steps=rounds)
    base.update(round_timeout_s=60.0, poll_s=0.01, keep_rounds=0)
    return DiLoCoConfig(**{**base, **cfg})


def _train(cb: ObjectStoreDiLoCoCallback, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(32, D_IN, generator=torch.Generator().manual_seed(100 + i))
    while not cb._stop:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    cb.close()


def _run(url: str, n: int, rounds: int, **cfg) -> list[ObjectStoreDiLoCoCallback]:
    models = [_model(i) for i in range(n)]  # here, not in the threads: the global RNG is shared
    out: list = [None] * n
    errors: list[BaseException] = []

    def replica(i: int) -> None:
        try:
            opt = torch.optim.SGD(models[i].parameters(), lr=0.1)
            log = f"{url.removeprefix('file://')}-sync{i}.jsonl"
            info = ReplicaInfo(i, n, run_id="deltas", sync_log=log)
            cb = ObjectStoreDiLoCoCallback(_config(url, rounds, **cfg), info)
            cb.attach(models[i], opt)
            _train(cb, models[i], opt, i)
            out[i] = cb
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _header(root: Path, key: str) -> dict:
    return unpack((root / key).read_bytes(), key)[0]


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _states(root: Path) -> list[int]:
    return sorted(int(p.name) for p in (root / "state").iterdir())


def _records(url: str, i: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{url.removeprefix('file://')}-sync{i}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("compress", ["int4", "sparseloco"])
def test_one_due_state_in_exact_every_is_written_and_training_does_not_change(tmp_path, compress):
    ref = _run(f"file://{tmp_path / 'every'}", 2, 6, compress=compress)
    reps = _run(f"file://{tmp_path / 'run'}", 2, 6, compress=compress, exact_every=3)
    # the last of every 3 due states (rounds 2 and 5); nothing is written for the others
    assert _states(tmp_path / "run") == [2, 5] and _states(tmp_path / "every") == list(range(6))
    # the global state is never replaced by a decoded one: bit for bit the run that writes every state
    for a, b in zip(ref, reps, strict=True):
        assert torch.equal(_flat(a.global_params), _flat(b.global_params))
    # a written state is exact and records its hash
    rs = RoundStore(ObjectStore(f"file://{tmp_path / 'run'}"), "deltas")
    state, head = rs.get_state("state/00000005"), _header(tmp_path / "run", "state/00000005")
    assert torch.equal(_flat(state["global_params"]), _flat(reps[0].global_params))
    assert "delta" not in head and head["hash"] == state_hash(flatten(state))


@pytest.mark.parametrize("compress", ["int4", "sparseloco"])
@pytest.mark.parametrize("keep_rounds", [2, 0])
def test_a_restart_between_written_states_rebuilds_the_rounds_and_ends_on_one_hash(tmp_path, compress, keep_rounds):
    root = tmp_path / "run"
    cfg = dict(compress=compress, exact_every=2, keep_rounds=keep_rounds)
    reps = _run(f"file://{root}", 2, 7, **cfg)
    # round 6 (the last) is not the last of 2 due states: nothing written for it, rebuilt from the means
    assert _states(root) == ([3, 5] if keep_rounds else [1, 3, 5])
    final = _flat(reps[0].global_params)
    assert torch.equal(final, _flat(reps[1].global_params))
    # the collector (at round 5: states before 3 and rounds up to 3 go) keeps every mean after the oldest state kept
    assert all((root / f"rounds/{r:08d}/mean-000").exists() for r in (4, 5, 6))
    assert (root / "rounds/00000003/mean-000").exists() == (keep_rounds == 0)
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    # the newest state gone (kept: state/3 and rounds 4-6), or every state (kept: init and every round)
    for r in [5] if keep_rounds else [1, 3, 5]:
        (copy / f"state/{r:08d}").unlink()
    model = _model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = ObjectStoreDiLoCoCallback(_config(f"file://{copy}", 7, **cfg), ReplicaInfo(1, 2, run_id="deltas", restart=1))
    cb.attach(model, opt)
    assert cb.round == 7 and cb._done
    assert torch.equal(_flat(cb.global_params), final)  # one hash with the replicas that never stopped
    # the outer momentum too (Nesterov SGD for int4: one buffer per parameter)
    live, mine = reps[1].outer_optimizers[0].state_dict()["state"], cb.outer_optimizers[0].state_dict()["state"]
    assert live.keys() == mine.keys()
    for k, v in live.items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(mine[k][name]), torch.as_tensor(t))
    # it wrote back the states it rebuilt that were due, bit for bit the closer's
    for r in [5] if keep_rounds else [1, 3, 5]:
        assert (copy / f"state/{r:08d}").read_bytes() == (root / f"state/{r:08d}").read_bytes()
    cb.close()


def test_the_sync_log_splits_bytes_written_by_kind(tmp_path):
    url = f"file://{tmp_path / 'run'}"
    reps = _run(url, 2, 4, compress="int4", exact_every=2)
    for i, cb in enumerate(reps):
        recs = _records(url, i)
        kinds = [r["bytes_by_kind"] for r in recs]
        assert all(set(k) == {"grad", "mean", "state", "init"} for k in kinds)
        # every part is within what was written; the rest is the manifest, run.json, small objects
        assert all(sum(k.values()) <= r["bytes_written"] for k, r in zip(kinds, recs, strict=True))
        assert sum(k["grad"] for k in kinds) == cb.bytes_pseudograd
        assert sum(k["state"] for k in kinds) == cb.bytes_states == sum(r["bytes_states"] for r in recs)
        assert all(k["mean"] > 0 for k in kinds)  # each replica writes its slice of every round's mean
    # the states written (rounds 1 and 3), counted once, by whoever wrote them
    written = sum((tmp_path / "run" / f"state/{r:08d}").stat().st_size for r in (1, 3))
    assert sum(r["bytes_by_kind"]["state"] for i in range(2) for r in _records(url, i)) == written
    assert sum(r["bytes_by_kind"]["init"] for i in range(2) for r in _records(url, i)) == (
        (tmp_path / "run" / "init").stat().st_size
    )


def test_exact_every_holds_for_compress_none_and_one_pins_nothing_new(tmp_path):
    root = tmp_path / "run"
    reps = _run(f"file://{root}", 2, 4, compress="none", exact_every=2)
    assert _states(root) == [1, 3] and '"exact_every": 2' in (root / "run.json").read_text()
    rs = RoundStore(ObjectStore(f"file://{root}"), "deltas")
    assert torch.equal(_flat(rs.get_state("state/00000003")["global_params"]), _flat(reps[0].global_params))
    _run(f"file://{tmp_path / 'one'}", 1, 1, compress="int4")
    assert "exact_every" not in (tmp_path / "one" / "run.json").read_text()  # a run.json as before


def test_a_delta_state_of_an_earlier_version_is_refused_naming_it_and_an_older_state_is_taken(tmp_path):
    root = tmp_path / "run"
    _run(f"file://{root}", 1, 2, compress="int4")
    header, body = unpack((root / "state/00000001").read_bytes(), "state/00000001")
    (root / "state/00000001").write_bytes(pack({**header, "delta": {"base": "state/00000000"}}, body))
    rs = RoundStore(ObjectStore(f"file://{root}"), "deltas")
    with pytest.raises(CorruptObjectError, match=r"state/00000001: a delta state .*diloco\.exact_every"):
        rs.get_state("state/00000001")
    assert rs.newest_valid_state()[0] == 0
    # a state whose vectors are not the ones its hash records is refused too
    header, body = unpack((root / "state/00000000").read_bytes(), "state/00000000")
    (root / "state/00000000").write_bytes(pack({**header, "hash": "0" * 64}, body))
    with pytest.raises(CorruptObjectError, match=r"state/00000000: its vectors do not match the hash it records"):
        rs.get_state("state/00000000")


def test_replicas_must_agree_on_exact_every(tmp_path):
    root = tmp_path / "run"
    _run(f"file://{root}", 1, 1, compress="int4", exact_every=4)
    for cfg in ({"exact_every": 2}, {}):
        cb = ObjectStoreDiLoCoCallback(
            _config(f"file://{root}", 1, compress="int4", **cfg), ReplicaInfo(0, 1, run_id="deltas")
        )
        model = _model(0)
        with pytest.raises(ConfigError, match=r"exact_every is 4 in the run, .* here.*diloco\.exact_every"):
            cb.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.timeout(480)
def test_a_replica_killed_between_written_states_rejoins_on_one_hash(tmp_path):
    """Real processes (``composer-plugins diloco``'s launcher, the toy target): replica 1 is SIGKILLed before the
    run's first written state and relaunched; it rebuilds the rounds from ``init`` and the stored means, and the
    run ends with both replicas on one hash and only the last of every 4 due states written."""
    import time

    from composer_plugins.diloco.launch import ReplicaGroup, replica_argv

    log_dir, root = tmp_path / "logs", tmp_path / "store"
    ov = ["diloco.sync_every=4", "diloco.transport=object_store", "diloco.round_timeout_s=20", "toy.max_steps=48"]
    ov += ["diloco.compress=int4", "diloco.exact_every=4"]
    argv = lambda i: replica_argv("toy", None, [*ov, f"toy.output={log_dir}/result{i}.json"])  # noqa: E731
    sync = log_dir / "replica1.sync.jsonl"
    with ReplicaGroup(
        argv,
        2,
        log_dir=log_dir,
        grace_s=5,
        threads_per_replica=1,
        transport="object_store",
        store=f"file://{root}",
        max_restarts=1,
    ) as g:
        deadline = time.monotonic() + 300
        while not sync.exists() or len(sync.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline, "replica 1 never synced twice"
            time.sleep(0.1)
        g.kill(1)
        res = g.wait(timeout=400)
    assert res.ok and res.restarts == {0: 0, 1: 1}
    second = [json.loads(line) for line in sync.read_text().splitlines() if json.loads(line)["restart"] == 1]
    assert second and second[-1]["committed"] and second[-1]["outer_step"] == 12
    outs = [json.loads((log_dir / f"result{i}.json").read_text()) for i in range(2)]
    assert len({o["param_hash"] for o in outs}) == 1
    assert _states(root) == [7, 11]  # 12 rounds: states 3, 7, 11 written, the oldest collected (keep_rounds 2)
