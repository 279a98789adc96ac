"""``StatesMixin`` (``diloco/objstore/states.py``) method by method, in process, on a stand-in replica: which
states are written with replay points, a saved state that does not fit, catching up when the pseudo-gradients
are gone, replaying closed rounds, the host copies the state writer encodes.

Written against the ``diloco/objstore`` mutants of seed 9192 that only the subprocess DiLoCo runs reached.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.objstore.rounds import StoreObjectError
from composer_plugins.diloco.objstore.states import StatesMixin, _host_tree


def test_with_replay_points_only_the_last_of_every_exact_every_due_states_is_written():
    me = SimpleNamespace(config=SimpleNamespace(state_every=2, exact_every=3))
    # due states at rounds 0-1 (block 0), 2-3 (1), 4-5 (2), ...: the third block of every three is written
    assert [r for r in range(14) if StatesMixin._state_written(me, r)] == [4, 5, 10, 11]
    me.config.exact_every = 1
    assert all(StatesMixin._state_written(me, r) for r in range(6))


def test_the_host_copy_of_a_cpu_tensor_does_not_share_its_storage():
    t = torch.arange(4.0)
    tree = _host_tree({"a": [t], "b": (t, 3)})
    t.add_(10.0)  # the optimizer keeps stepping while the writer encodes the copy
    assert torch.equal(tree["a"][0], torch.arange(4.0)) and torch.equal(tree["b"][0], torch.arange(4.0))
    assert tree["b"][1] == 3


def _replica(**over):
    g = [torch.zeros(3)]
    me = SimpleNamespace(
        global_params=g,
        params=[torch.zeros(3)],
        outer_optimizers=[torch.optim.SGD(g, lr=0.7, momentum=0.9)],
        store=SimpleNamespace(where="file:///run"),
        calls=[],
    )
    me._at_round = lambda k: setattr(me, "round", k)
    me._healed = lambda: me.calls.append("healed")
    for k, v in over.items():
        setattr(me, k, v)
    return me


def test_a_saved_state_of_another_shape_is_refused_naming_its_key_and_one_that_fits_is_taken():
    me = _replica()
    bad = {"global_params": [torch.ones(4)], "outer_optimizers": [me.outer_optimizers[0].state_dict()]}
    with pytest.raises(StoreObjectError, match=r"file:///run/state/00000003 does not fit this model: .*shape \[4\]"):
        StatesMixin._apply_state(me, 3, bad)
    assert not hasattr(me, "round")
    good = {"global_params": [torch.ones(3)], "outer_optimizers": [me.outer_optimizers[0].state_dict()]}
    StatesMixin._apply_state(me, 3, good)
    assert me.round == 4 and me.calls == ["healed"]
    assert torch.equal(me.global_params[0], torch.ones(3)) and torch.equal(me.params[0], torch.ones(3))


def _late(found, timeout_s=60.0):
    me = _replica()
    me.config = SimpleNamespace(round_timeout_s=timeout_s, poll_s=0.0)
    polls = []

    def newest_valid_state(at_least):
        polls.append(at_least)
        return found if len(polls) >= 2 else None  # the state appears at the second look

    me.rounds = SimpleNamespace(newest_valid_state=newest_valid_state, store=me.store)
    me._apply_round = lambda *a, **k: False  # the round's pseudo-gradients are unreadable
    me._take_init_globals = lambda: True
    me._apply_state = lambda k, s: me.calls.append(("state", k, s))
    me._replay_closed_rounds = lambda: me.calls.append("replay")
    me._align_to_others = lambda: me.calls.append("align")
    return me, polls


def test_a_replica_left_out_with_the_round_unreadable_waits_for_a_newer_state_and_takes_it():
    me, polls = _late((5, "S"))
    StatesMixin._catch_up(me, 4, {"grads": {}})
    assert polls == [4, 4] and me.calls == [("state", 5, "S"), "replay", "align"]
    me, _ = _late(None, timeout_s=0.0)
    with pytest.raises(ComposerPluginsError, match=r"round 4 closed without this replica.*round_timeout_s=0s"):
        StatesMixin._catch_up(me, 4, {"grads": {}})


def test_a_replica_left_out_of_a_readable_round_rebuilds_it_without_waiting_for_a_state():
    me, polls = _late((5, "S"), timeout_s=0.0)
    me._apply_round = lambda r, m, local, mix_local: me.calls.append(("round", r, mix_local)) is None
    StatesMixin._catch_up(me, 4, {"grads": {}})
    assert polls == [] and me.calls == [("round", 4, False), "healed", "replay", "align"]
    # round 0 with init_sync: only once init's global weights are taken; without init, it waits for a state
    me, polls = _late((0, "S"), timeout_s=60.0)
    me._apply_round = lambda r, m, local, mix_local: me.calls.append(("round", r, mix_local)) is None
    StatesMixin._catch_up(me, 0, {"grads": {}})
    assert polls == [] and me.calls[0] == ("round", 0, False)
    me, polls = _late((0, "S"), timeout_s=60.0)
    me._take_init_globals = lambda: False
    me._apply_round = lambda *a, **k: pytest.fail("round 0 rebuilt without init's weights")
    StatesMixin._catch_up(me, 0, {"grads": {}})
    assert polls == [0, 0] and me.calls == [("state", 0, "S"), "replay", "align"]


def test_every_closed_round_with_a_manifest_is_replayed_in_order():
    me = _replica(round=1, replica=SimpleNamespace(index=0))
    applied = []

    def apply_round(r, m, local, mix_local):
        applied.append((r, m["n"], mix_local))
        me.round = r + 1
        return True

    me._apply_round = apply_round
    me._state_due = lambda r: False
    me.rounds = SimpleNamespace(manifest=lambda r: {"n": r} if r in (1, 2) else None, store=me.store)
    assert StatesMixin._replay_closed_rounds(me) == 2
    assert applied == [(1, 1, False), (2, 2, False)] and me.round == 3 and me.calls == ["healed", "healed"]


def test_run_json_pins_state_every_and_exact_every_only_with_replay_points():
    from composer_plugins.diloco.objstore.identity import RunIdentityMixin

    p = torch.nn.Parameter(torch.zeros(2, 3))
    me = SimpleNamespace(
        params=[p],
        run_id="ref",
        replica=SimpleNamespace(num_replicas=2),
        config=SimpleNamespace(sync_every=4, compress="none", state_every=2, exact_every=1),
        outer_optimizers=[torch.optim.SGD([p], lr=0.7)],
        _inner=torch.optim.SGD([p], lr=0.1),
    )
    me._replay_points = lambda: StatesMixin._replay_points(me)
    plain = RunIdentityMixin._run_identity(me)
    assert "state_every" not in plain and "exact_every" not in plain and plain["param_shapes"] == [[2, 3]]
    me.config.exact_every = 3
    pinned = RunIdentityMixin._run_identity(me)
    assert pinned["state_every"] == 2 and pinned["exact_every"] == 3


def test_closing_without_an_own_pseudo_gradient_checks_an_older_one_of_its_own_and_refuses_it():
    """This replica published nothing this round (``mine_name`` None: refused) but the round holds an unreadable
    pseudo-gradient under its index from an earlier launch: it is read like anyone's, refused, and the round
    closes with the other replica's."""
    from composer_plugins.diloco.objstore.aggregate import AggregateMixin

    read, closed = [], []

    def read_grad_index(r, name, numel):
        read.append(name)
        return None if name == "grad-0-1" else {"numel": numel}

    rs = SimpleNamespace(
        manifest=lambda r: None,
        grads_present=lambda r: {0: ["grad-0-1"], 1: ["grad-1-0"]},
        read_grad_index=read_grad_index,
        refused=lambda r: {0: "refused: non-finite pseudo-gradient"},
        close_round=lambda r, good, me, slices: closed.append((r, dict(good), me, slices)) or ({"grads": good}, True),
        store=SimpleNamespace(where="file:///run"),
    )
    me = SimpleNamespace(
        rounds=rs,
        config=SimpleNamespace(round_timeout_s=60.0, poll_s=0.0, poll_max_s=0.0),
        replica=SimpleNamespace(num_replicas=2),
        params=[torch.zeros(5)],
        _stopped={},
    )
    manifest, created = AggregateMixin._close(me, 3, 0, None)
    assert manifest == {"grads": {1: "grad-1-0"}}
    assert created and closed == [(3, {1: "grad-1-0"}, 0, 2)] and sorted(read) == ["grad-0-1", "grad-1-0"]
    # its own pseudo-gradient of this round is taken without reading its index back
    read.clear()
    rs.grads_present = lambda r: {0: ["grad-0-2"], 1: ["grad-1-0"]}
    closed.clear()
    AggregateMixin._close(me, 3, 0, "grad-0-2")
    assert read == ["grad-1-0"] and closed == [(3, {0: "grad-0-2", 1: "grad-1-0"}, 0, 2)]


def test_an_overlapped_round_closed_without_this_replica_is_not_applied_as_its_own():
    """``overlap: 1``: the replica published, but the round closed without it (late): the background job must
    not take the outer step as a participant; the foreground catches up instead."""
    from composer_plugins.diloco.objstore.callback import ObjectStoreDiLoCoCallback

    applied = []
    me = SimpleNamespace(
        replica=SimpleNamespace(index=0, num_replicas=2, sync_log=False),
        config=SimpleNamespace(init_sync=False, sync_log=False, log_param_hash=False),
        params=[torch.zeros(3)],
        rounds=SimpleNamespace(manifest=lambda r: None),
        _publish=lambda r, snapshot: ("grad-0-2", torch.zeros(3), None),
        _close=lambda r, i, name: ({"grads": {"1": "grad-1-2"}, "participants": [1]}, True),
        _apply_round=lambda *a, **k: applied.append(a) or True,
        _state_due=lambda r: False,
        _background=None,
    )
    ObjectStoreDiLoCoCallback._launch_overlapped(me, 2, 0.0)
    try:
        manifest, committed = me._overlapped[1].result(timeout=30)
    finally:
        me._background.shutdown()
    assert manifest["participants"] == [1] and not committed and applied == []


def test_a_replica_starting_from_init_takes_its_model_optimizer_and_learning_rate_schedule():
    torch.manual_seed(0)
    src, dst = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    src_opt, dst_opt = torch.optim.SGD(src.parameters(), lr=0.1), torch.optim.SGD(dst.parameters(), lr=0.1)
    src_sched = torch.optim.lr_scheduler.StepLR(src_opt, step_size=1, gamma=0.5)
    for _ in range(3):
        src_opt.step()
        src_sched.step()
    dst_sched = torch.optim.lr_scheduler.StepLR(dst_opt, step_size=1, gamma=0.5)
    init = {
        "model": src.state_dict(),
        "inner_optimizer": src_opt.state_dict(),
        "lr_schedulers": [src_sched.state_dict()],
        "global_params": [p.detach().clone() for p in src.parameters()],
    }
    looks = iter(range(10))  # init appears at the third look (the wait backs off between looks)
    me = _replica(
        global_params=[torch.zeros_like(p) for p in dst.parameters()],
        replica=SimpleNamespace(index=1),
        config=SimpleNamespace(barrier_timeout_s=60.0, poll_s=0.0, poll_max_s=0.0),
        rounds=SimpleNamespace(
            get_state=lambda key: init if key == "init" and next(looks) >= 2 else None,
            store=SimpleNamespace(where="file:///run"),
        ),
        _module=dst,
        _inner=dst_opt,
        _trainer=SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=dst_sched)]),
    )
    StatesMixin._init_sync(me)
    assert dst_sched.last_epoch == 3 and dst_sched.get_last_lr() == src_sched.get_last_lr()
    for a, b, g in zip(dst.parameters(), src.parameters(), me.global_params, strict=True):
        assert torch.equal(a, b) and torch.equal(g, b)
    assert me.calls == ["healed"]
    # an init holding fewer global parameters than the model has is refused, naming it
    init["global_params"] = init["global_params"][:1]
    looks = iter(range(2, 10))
    with pytest.raises(StoreObjectError, match=r"/init does not fit this model"):
        StatesMixin._init_sync(me)


def test_a_replica_joining_a_round_late_takes_only_the_inner_steps_left(monkeypatch, caplog):
    import logging

    from composer_plugins.diloco.objstore import states

    times = {2: 99.6, 3: 100.0}  # the last round took 0.4 s over H = 4 steps: 0.1 s a step
    me = SimpleNamespace(
        config=SimpleNamespace(sync_every=4),
        round=4,
        _since_sync=0,
        replica=SimpleNamespace(index=1),
        rounds=SimpleNamespace(manifest=lambda r: {"time": times[r]} if r in times else None),
    )
    monkeypatch.setattr(states.time, "time", lambda: 100.35)  # 0.35 s after the others' last sync
    with caplog.at_level(logging.INFO, logger="composer_plugins.diloco.objstore"):
        assert StatesMixin._align_to_others(me) == 3
    assert me._since_sync == 3
    assert any("joins round 4" in m and "1 of its 4 inner steps" in m for m in caplog.messages), caplog.messages
    me.config.sync_every, me._since_sync = 8, 0  # H = 8, 0.05 s a step, 0.1 s late: 6 of its 8 steps
    with caplog.at_level(logging.INFO, logger="composer_plugins.diloco.objstore"):
        monkeypatch.setattr(states.time, "time", lambda: 100.1 + 1e-9)
        assert StatesMixin._align_to_others(me) == 2
    assert any("joins round 4" in m and "6 of its 8 inner steps" in m for m in caplog.messages), caplog.messages
    me.config.sync_every = 4
    monkeypatch.setattr(states.time, "time", lambda: 100.45)  # a whole round late: it starts the round whole
    me._since_sync = 0
    assert StatesMixin._align_to_others(me) == 0 and me._since_sync == 0


# --- the survivors of held-out seeds 9301/9302 (benchmarks/README.md, "Mutation testing") ---


def test_put_state_counts_init_bytes_as_init_and_a_global_state_as_state(tmp_path):
    from composer_plugins.diloco.objstore import RoundStore
    from composer_plugins.diloco.store import ObjectStore

    rs = RoundStore(ObjectStore(f"file://{tmp_path}/run"))
    n_init = rs.put_state("init", {"global_params": [torch.ones(3)]})
    assert n_init > 0 and rs.bytes_by_kind["init"] == n_init and rs.bytes_by_kind["state"] == 0
    n_state = rs.put_state("state/00000002", {"global_params": [torch.ones(5)]})
    assert n_state > 0 and rs.bytes_by_kind["state"] == n_state and rs.bytes_by_kind["init"] == n_init


def test_from_round_0_the_closed_rounds_are_replayed_when_round_0_has_a_manifest():
    me = _replica(round=0, replica=SimpleNamespace(index=0))
    me._take_init_globals = lambda: True
    me._state_due = lambda r: False

    def apply_round(r, m, local, mix_local):
        me.round = r + 1
        return True

    me._apply_round = apply_round
    me.rounds = SimpleNamespace(manifest=lambda r: {"n": r} if r == 0 else None, store=me.store)
    assert StatesMixin._replay_closed_rounds(me) == 1 and me.round == 1
    # no manifest of round 0 (only of round 1): nothing is replayed from init
    me.round = 0
    me.rounds.manifest = lambda r: {"n": r} if r == 1 else None
    assert StatesMixin._replay_closed_rounds(me) == 0 and me.round == 0


def test_aligning_skips_no_inner_step_before_round_2_or_without_two_manifests_or_their_times():
    def me_at(r, h=4, times=None):
        return SimpleNamespace(
            config=SimpleNamespace(sync_every=h),
            round=r,
            _since_sync=0,
            replica=SimpleNamespace(index=1),
            rounds=SimpleNamespace(manifest=lambda k: None if times is None or k not in times else times[k]),
        )

    assert StatesMixin._align_to_others(me_at(1, times={0: {"time": 1.0}})) == 0
    assert StatesMixin._align_to_others(me_at(4, h=1, times={2: {"time": 1.0}, 3: {"time": 2.0}})) == 0
    assert StatesMixin._align_to_others(me_at(4, times={3: {"time": 2.0}})) == 0
    assert StatesMixin._align_to_others(me_at(4, times={2: {}, 3: {"time": 2.0}})) == 0
    assert StatesMixin._align_to_others(me_at(4, times={2: {"time": 9.0}, 3: {"time": 2.0}})) == 0


def test_a_round_where_every_replica_refused_raises_naming_each_refusal_and_the_hint():
    from composer_plugins.diloco.objstore.aggregate import AggregateMixin

    rs = SimpleNamespace(
        manifest=lambda r: None,
        grads_present=lambda r: {},
        read_grad_index=lambda r, name, numel: None,
        refused=lambda r: {0: "stopped: codec x failed", 1: "its pseudo-gradient is not finite"},
        store=SimpleNamespace(where="file:///run"),
        round_dir=lambda r: f"rounds/{r:08d}",
    )
    me = SimpleNamespace(
        rounds=rs,
        config=SimpleNamespace(round_timeout_s=60.0, poll_s=0.0, poll_max_s=0.0),
        replica=SimpleNamespace(num_replicas=2),
        params=[torch.zeros(5)],
        _stopped={},
    )
    with pytest.raises(ComposerPluginsError) as e:
        AggregateMixin._close(me, 3, 0, None)
    msg = str(e.value)
    assert "round 3: no replica has a pseudo-gradient (file:///run/rounds/00000003)" in msg
    assert "replica 0: stopped: codec x failed; replica 1: its pseudo-gradient is not finite. HINT:" in msg
    assert msg.endswith("lower the learning rate.") and me._stopped == {0: "stopped: codec x failed"}


def test_a_live_round_already_settled_makes_no_partial_mean_when_a_slice_is_gone():
    """The round has a state (its participants applied it and ``keep_rounds`` collected it): a missing slice of
    another replica's pseudo-gradient yields no mean at all, even with this replica's own in hand."""
    from composer_plugins.diloco.objstore.aggregate import AggregateMixin

    written = []
    rs = SimpleNamespace(
        read_grad_index=lambda r, name, numel: None,
        put_mean=lambda r, j, vec, codec, count: written.append((j, count)) or (vec, True),
        get_mean=lambda r, j, n: None,
    )
    me = SimpleNamespace(
        rounds=rs,
        config=SimpleNamespace(compress="none", round_timeout_s=60.0, poll_s=0.0, poll_max_s=0.0),
        replica=SimpleNamespace(index=0),
        params=[torch.zeros(4)],
        _mean_residual={},
        _round_settled=lambda r: True,
    )
    manifest = {"participants": [0, 1], "slices": 1, "grads": {"0": "grad-0-0", "1": "grad-1-0"}}
    assert AggregateMixin._round_mean(me, 3, manifest, torch.ones(4)) is None and written == []
    # not settled (live): the slice is left out and the mean is made of this replica's own
    me._round_settled = lambda r: False
    assert torch.equal(AggregateMixin._round_mean(me, 3, manifest, torch.ones(4)), torch.ones(4))
    assert written == [(0, 1)]


def test_a_codec_feedback_decay_below_one_scales_the_carried_residual(monkeypatch):
    from composer_plugins.diloco.objstore import callback

    codec = SimpleNamespace(feedback_decay=0.5, error_feedback=False)
    monkeypatch.setattr(callback, "get_codec", lambda name: codec)
    put = []
    me = SimpleNamespace(
        config=SimpleNamespace(compress="none", init_sync=False),
        replica=SimpleNamespace(num_replicas=1, index=0, restart=0),
        global_params=[torch.full((4,), 3.0)],
        params=[torch.ones(4)],
        _residual=torch.full((4,), 2.0),
        bytes_pseudograd=0,
        rounds=SimpleNamespace(put_grad=lambda r, i, k, parts: put.append(parts) or ("grad-0-0", 7)),
    )
    name, mine, err = callback.ObjectStoreDiLoCoCallback._publish(me, 2, [torch.ones(4)])
    assert name == "grad-0-0" and err == 0.0 and me.bytes_pseudograd == 7
    assert torch.equal(mine, torch.full((4,), 3.0))  # (3 - 1) + 0.5 * 2
    codec.feedback_decay = 1.0
    _, mine, _ = callback.ObjectStoreDiLoCoCallback._publish(me, 2, [torch.ones(4)])
    assert torch.equal(mine, torch.full((4,), 4.0))


def _recorder(tmp_path, **over):
    from composer_plugins.diloco.glue import DiLoCoCallbackBase

    me = SimpleNamespace(
        config=SimpleNamespace(sync_log=None, log_param_hash=False, stop_file=None, overlap=0),
        replica=SimpleNamespace(index=0, replica_id="r0", restart=0, stop_file=None, sync_log=None),
        store=SimpleNamespace(bytes_written=10, bytes_read=4, retries=0),
        _counted=(0, 0, 0),
        bytes_states=0,
        _states_counted=0,
        rounds=None,
        _kinds_counted={},
        round=3,
        _inner_steps=12,
        _healed_since_sync=False,
        bytes_allreduced=0,
        transport="objstore",
        _target=None,
        _stop=False,
        history=[],
        _trainer=SimpleNamespace(should_stop=False),
    )
    for name in ("stop_file_says_stop", "_sync_record", "_keep_sync"):
        setattr(me, name, getattr(DiLoCoCallbackBase, name).__get__(me))
    for k, v in over.items():
        setattr(me, k, v)
    return me


def test_a_stop_file_stops_the_run_at_the_round_it_names(tmp_path):
    from composer_plugins.diloco.objstore.callback import ObjectStoreDiLoCoCallback

    stop = tmp_path / "STOP"
    stop.write_text("5")
    me = _recorder(tmp_path)
    me.config.stop_file = str(stop)
    rec = ObjectStoreDiLoCoCallback._record(me, 2, True, 2, 0.0, 0.1)
    assert rec["stop"] is False and not me._trainer.should_stop and rec["bytes_written"] == 10
    me.round = 5
    rec = ObjectStoreDiLoCoCallback._record(me, 4, True, 2, 0.0, 0.1)
    assert rec["stop"] is True and me._stop and me._trainer.should_stop


def test_settling_a_round_closed_without_this_replica_records_it_not_committed_with_its_duration():
    import time

    from composer_plugins.diloco.objstore.callback import ObjectStoreDiLoCoCallback

    recorded, caught = [], []
    me = SimpleNamespace(
        replica=SimpleNamespace(index=0),
        _apply_round=lambda *a, **k: True,
        _catch_up=lambda r, m: caught.append(r),
        _record=lambda *a: recorded.append(a),
    )
    manifest = {"grads": {"1": "grad-1-0"}, "participants": [1]}
    t0 = time.perf_counter()
    ObjectStoreDiLoCoCallback._settle(me, 4, manifest, False, "grad-0-0", torch.zeros(3), 0.0, t0)
    ((r, committed, participants, err, seconds),) = recorded
    assert caught == [4] and (r, committed, participants, err) == (4, False, 1, 0.0)
    assert 0.0 <= seconds < 0.5


# --- the survivors of seed 6704 (issue 67; benchmarks/README.md, "Mutation testing") ---


def test_rebuilding_round_0_takes_inits_global_weights_and_refuses_a_damaged_init(tmp_path):
    from composer_plugins.diloco.objstore import RoundStore
    from composer_plugins.diloco.store import ObjectStore

    rs = RoundStore(ObjectStore(f"file://{tmp_path}/run"))
    me = _replica(rounds=rs, config=SimpleNamespace(init_sync=True), replica=SimpleNamespace(num_replicas=2))
    assert StatesMixin._take_init_globals(me) is False  # no init yet: nothing taken
    assert torch.equal(me.global_params[0], torch.zeros(3)) and torch.equal(me.params[0], torch.zeros(3))
    rs.put_state("init", {"global_params": [torch.arange(3.0)]})
    assert StatesMixin._take_init_globals(me) is True
    assert torch.equal(me.global_params[0], torch.arange(3.0)) and torch.equal(me.params[0], torch.arange(3.0))
    rs.store.put("init", b"junk")
    with pytest.raises(StoreObjectError, match=r"run/init: not a DiLoCo store object.*refused"):
        StatesMixin._take_init_globals(me)
    me.replica.num_replicas = 1  # one replica: round 0 started from its own weights
    assert StatesMixin._take_init_globals(me) is True


def test_a_state_written_with_replay_points_records_the_hash_of_its_vectors(tmp_path):
    from composer_plugins.diloco.objstore import RoundStore
    from composer_plugins.diloco.objstore.statehash import flatten, state_hash
    from composer_plugins.diloco.store import ObjectStore, unpack

    rs = RoundStore(ObjectStore(f"file://{tmp_path}/run"))
    state = {"round": 4, "global_params": [torch.arange(3.0)]}
    for hashed, key in ((True, "state/00000003"), (False, "state/00000005")):
        r = int(key[-1])
        me = SimpleNamespace(rounds=rs, bytes_states=0, _replay_points=lambda h=hashed: h, _global_state=lambda: state)
        StatesMixin._put_state(me, r)()
        header, _ = unpack(rs.store.get(key))
        assert header.get("hash") == (state_hash(flatten(state)) if hashed else None)
        assert me.bytes_states == len(rs.store.get(key)) and rs.get_state(key)["round"] == 4


def test_a_sync_record_counts_the_bytes_of_each_kind_written_since_the_last(tmp_path):
    from composer_plugins.diloco.objstore.callback import ObjectStoreDiLoCoCallback

    me = _recorder(tmp_path, rounds=SimpleNamespace(bytes_by_kind={"grad": 100, "mean": 12, "state": 0}))
    me._kinds_counted = {"grad": 40, "mean": 12}
    rec = ObjectStoreDiLoCoCallback._record(me, 2, True, 2, 0.0, 0.1)
    assert rec["bytes_by_kind"] == {"grad": 60, "mean": 0, "state": 0}
    assert me._kinds_counted == {"grad": 100, "mean": 12, "state": 0}


def test_a_new_replica_has_written_no_pseudo_gradient_bytes(tmp_path):
    from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
    from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback

    config = DiLoCoConfig(transport="object_store", store=f"file://{tmp_path}/run", run_id="r")
    cb = ObjectStoreDiLoCoCallback(config, ReplicaInfo(index=0, num_replicas=2, run_id="r"))
    assert cb.bytes_allreduced == 0
