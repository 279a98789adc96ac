"""Global states as compressed deltas (``diloco.exact_every``, :mod:`composer_plugins.diloco.objstore.deltas`):
the chain a load walks back, the errors of a broken chain, a restart from a delta state, the bytes."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from composer_plugins.core.errors import ConfigError
from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo, param_digest
from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback
from composer_plugins.diloco.objstore.deltas import flatten, state_hash
from composer_plugins.diloco.objstore.rounds import RoundStore
from composer_plugins.diloco.store import CorruptObjectError, ObjectStore, unpack

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


def test_a_chain_exact_delta_delta_loads_to_what_the_replicas_hold(tmp_path):
    root = tmp_path / "run"
    reps = _run(f"file://{root}", 2, 4, compress="int4", exact_every=4)
    heads = [_header(root, f"state/{r:08d}") for r in range(4)]
    assert "delta" not in heads[0] and "delta" in heads[1] and "delta" in heads[2]
    assert "delta" in heads[3]  # the last round's state too: the rule is by round only
    assert heads[2]["delta"]["base"] == "state/00000001" and heads[2]["delta"]["base_hash"] == heads[1]["hash"]
    rs = RoundStore(ObjectStore(f"file://{root}"), "deltas")
    state = rs.get_state("state/00000002")  # exact -> delta -> delta
    assert state_hash(flatten(state)[1]) == heads[2]["hash"]
    # bit for bit the weights every replica held after round 2 (their sync records' parameter hashes)
    for cb in reps:
        (rec,) = [h for h in cb.history if h["round"] == 2]
        assert rec["param_hash"] == param_digest(state["global_params"])[0]
    assert torch.equal(_flat(rs.get_state("state/00000003")["global_params"]), _flat(reps[1].global_params))
    # the outer momentum travels in the chain too (Nesterov SGD: one buffer per parameter)
    mom = [v["momentum_buffer"] for v in rs.get_state("state/00000003")["outer_optimizers"][0]["state"].values()]
    live = [v["momentum_buffer"] for v in reps[1].outer_optimizers[0].state_dict()["state"].values()]
    assert torch.equal(_flat(mom), _flat(live))


def test_a_corrupt_or_missing_base_is_a_located_error_and_an_older_state_is_taken(tmp_path):
    root = tmp_path / "run"
    _run(f"file://{root}", 2, 4, compress="int4", exact_every=8)
    rs = RoundStore(ObjectStore(f"file://{root}"), "deltas")
    good = rs.get_state("state/00000001")
    # a base replaced by another intact object (its hash differs): refused, naming both
    (root / "state/00000001").write_bytes((root / "state/00000000").read_bytes())
    with pytest.raises(CorruptObjectError, match=r"state/00000002: a delta on .*state/00000001 with hash"):
        rs.get_state("state/00000002")
    # a torn base: the error names the delta and the base
    data = bytearray((root / "state/00000000").read_bytes())
    data[-1] ^= 0xFF
    (root / "state/00000001").write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError, match=r"state/00000002: a delta on a state that cannot be read"):
        rs.get_state("state/00000002")
    # a missing base
    (root / "state/00000001").unlink()
    with pytest.raises(CorruptObjectError, match=r"state/00000002: a delta on .*state/00000001, which is missing"):
        rs.get_state("state/00000002")
    # state/3 (a delta on state/2) cannot be rebuilt either: the newest intact state is state/0
    k, state = rs.newest_valid_state()
    assert k == 0 and not torch.equal(_flat(state["global_params"]), _flat(good["global_params"]))


@pytest.mark.parametrize("compress", ["int4", "sparseloco"])
def test_a_restart_from_a_delta_state_ends_every_replica_on_one_hash(tmp_path, compress):
    root = tmp_path / "run"
    reps = _run(f"file://{root}", 2, 6, compress=compress, exact_every=4)
    assert "delta" in _header(root, "state/00000002") and "delta" not in _header(root, "state/00000004")
    final = _flat(reps[0].global_params)
    assert torch.equal(final, _flat(reps[1].global_params))
    # replica 1 restarts from state/2 (a delta): the later states are gone, the rounds are there to replay
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    kept = (copy / "state/00000003").read_bytes()
    for r in (3, 4, 5):
        (copy / f"state/{r:08d}").unlink()
    model = _model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = ObjectStoreDiLoCoCallback(
        _config(f"file://{copy}", 6, compress=compress, exact_every=4), ReplicaInfo(1, 2, run_id="deltas", restart=1)
    )
    cb.attach(model, opt)
    assert cb.round == 6 and cb._done
    assert torch.equal(_flat(cb.global_params), final)  # one hash with the replicas that never stopped
    # the states it rebuilt are the same objects, bit for bit (the codec's bytes are deterministic)
    assert (copy / "state/00000003").read_bytes() == kept
    cb.close()


def test_states_written_as_deltas_are_a_fraction_of_exact_ones(tmp_path):
    sizes = {}
    for every in (1, 8):
        root = tmp_path / f"e{every}"
        _run(f"file://{root}", 2, 5, compress="int4", exact_every=every)
        sizes[every] = sum((root / f"state/{r:08d}").stat().st_size for r in range(1, 4))
    # int4: half a byte a value against four, plus the skeleton and the codec's scales
    assert sizes[8] < 0.25 * sizes[1]


def test_compress_none_writes_exact_states_and_pins_nothing_new(tmp_path):
    root = tmp_path / "run"
    reps = _run(f"file://{root}", 2, 3, compress="none", exact_every=4)
    for r in range(3):
        assert "delta" not in _header(root, f"state/{r:08d}")
    assert "exact_every" not in (root / "run.json").read_text()
    rs = RoundStore(ObjectStore(f"file://{root}"), "deltas")
    assert torch.equal(_flat(rs.get_state("state/00000001")["global_params"]), _flat(reps[0].global_params)) is False
    assert torch.equal(_flat(rs.get_state("state/00000002")["global_params"]), _flat(reps[0].global_params))


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
