"""DiLoCo building blocks and the launcher's process handling (fast; no torchft replicas)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import click
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from composer_plugins.core.config import loads_config
from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.diloco import launch


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    """True once none of ``pids`` is running (a killed process may take a moment to die)."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# -- config ------------------------------------------------------------------------------


def test_config_defaults_are_the_paper_outer_optimizer():
    from composer_plugins.diloco.common import DiLoCoConfig
    from composer_plugins.diloco.common import build_outer_optimizer as _build_outer

    c = DiLoCoConfig.from_config(loads_config("diloco: {sync_every: 10}"))
    assert c.sync_every == 10 and c.num_fragments == 1 and c.checkpoint_transport == "pg"
    opt = _build_outer(c, [nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.SGD)
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"]) == (0.7, 0.9, True)


def test_config_outer_optimizer_class_path():
    from composer_plugins.diloco.common import DiLoCoConfig
    from composer_plugins.diloco.common import build_outer_optimizer as _build_outer

    c = DiLoCoConfig.from_config(
        loads_config("diloco:\n  outer_optimizer: {class_path: torch.optim.Adam, init_args: {lr: 0.1}}\n")
    )
    opt = _build_outer(c, [nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("diloco: {sync_every: 0}", "diloco.sync_every"),
        ("diloco: {sync_every: 10, num_fragments: 3}", "diloco.num_fragments"),
        ("diloco: {sync_every: 4, num_fragments: 2, fragment_sync_delay: 2}", "diloco.fragment_sync_delay"),
        ("diloco: {fragment_update_alpha: 1.5}", "diloco.fragment_update_alpha"),
        ("diloco: {sync_evry: 3}", "diloco.sync_evry"),
        ("diloco: {checkpoint_transport: tcp}", "diloco.checkpoint_transport"),
    ],
)
def test_config_errors_name_the_key_and_line(text, key):
    from composer_plugins.diloco.common import DiLoCoConfig

    cfg = loads_config("seed: 1\n" + text, source="run.yaml")
    with pytest.raises(ConfigError) as e:
        DiLoCoConfig.from_config(cfg)
    assert e.value.key == key
    assert "run.yaml:2" in str(e.value)


def test_callback_from_config_only_in_a_replica(monkeypatch):
    from composer_plugins.diloco.replica import diloco_callback_from_config

    cfg = loads_config("diloco: {sync_every: 4}")
    assert diloco_callback_from_config(cfg, env={}) is None
    cb = diloco_callback_from_config(
        cfg,
        env={
            launch.ENV_LIGHTHOUSE: "http://127.0.0.1:1",
            launch.ENV_INDEX: "3",
            launch.ENV_NUM: "4",
            launch.ENV_SEED: "7",
            launch.ENV_RESTART: "1",
        },
    )
    assert cb is not None and cb.config.sync_every == 4
    r = cb.replica
    assert (r.index, r.num_replicas, r.replica_id, r.seed, r.restart) == (3, 4, "replica3", 7, 1)


def test_attach_without_lighthouse_says_how_to_fix(monkeypatch):
    from composer_plugins.diloco.common import ReplicaInfo
    from composer_plugins.diloco.strategy import DiLoCoCallback

    monkeypatch.delenv(launch.ENV_LIGHTHOUSE, raising=False)
    m = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="lighthouse"):
        DiLoCoCallback(replica=ReplicaInfo()).attach(m, torch.optim.SGD(m.parameters(), lr=0.1))


# -- fragments / digests -------------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_split_fragments_share_parameters_and_cover_each_once():
    from composer_plugins.diloco.common import split_fragments

    m = _Tied()
    trainable = [p for p in m.parameters() if p.requires_grad]
    for n in (1, 2, 3):
        frags = split_fragments(m, n)
        assert len(frags) == n
        got = [p for f in frags for p in f.parameters()]
        assert len(got) == len(trainable)
        assert {id(p) for p in got} == {id(p) for p in trainable}  # the same objects, tied once, frozen excluded
        assert all(len(list(f.parameters())) > 0 for f in frags)
    with pytest.raises(ComposerPluginsError, match="at most 3 fragments"):
        split_fragments(m, 4)


def test_split_fragments_balances_sizes():
    from composer_plugins.diloco.common import split_fragments

    m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    sizes = [sum(p.numel() for p in f.parameters()) for f in split_fragments(m, 4)]
    assert sizes == [144, 144, 144, 144]


def test_param_digest_is_bitwise():
    from composer_plugins.diloco.common import param_digest

    a = [torch.ones(3), torch.zeros(2, 2)]
    b = [t.clone() for t in a]
    assert param_digest(a) == param_digest(b)
    b[0][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert param_digest(a)[0] != param_digest(b)[0]
    assert param_digest(a)[1] == 3.0


def test_counting_process_group_counts_allreduce_bytes():
    from datetime import timedelta

    from torch.distributed import TCPStore

    from composer_plugins.diloco.strategy import make_process_group

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = make_process_group(timedelta(seconds=10))
    pg.configure(f"127.0.0.1:{store.port}/t", "r0", 0, 1)
    t = torch.ones(10)
    pg.allreduce([t], torch.distributed.ReduceOp.SUM).wait()
    assert pg.bytes_allreduced == 40 and pg.allreduce_calls == 1
    assert torch.equal(t, torch.ones(10))


# -- launcher ---------------------------------------------------------------------------------

SLEEPER = [
    sys.executable,
    "-c",
    "import time, subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)",
]


def test_group_stop_terminates_replicas_and_their_children(tmp_path):
    g = launch.ReplicaGroup(SLEEPER, 2, lighthouse="127.0.0.1:1", log_dir=tmp_path, grace_s=3)
    try:
        g.start()
        pids = [r.handle.pid for r in g.replicas]
        assert all(_alive(p) for p in pids)
        time.sleep(0.5)  # let each replica start its grandchild
        kids = [int(p) for pid in pids for p in os.popen(f"pgrep -g {pid}").read().split() if int(p) != pid]
    finally:
        g.stop()
    assert len(kids) == 2
    assert _gone(pids + kids)


def test_group_sets_replica_environment(tmp_path):
    script = "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if 'DILOCO' in k or 'FT_' in k}))"
    g = launch.ReplicaGroup(
        [sys.executable, "-c", script], 2, lighthouse="http://10.0.0.1:29510", log_dir=tmp_path, base_seed=100
    )
    with g:
        res = g.wait(timeout=60)
    assert res.ok and res.exit_codes == {0: [0], 1: [0]}
    import json

    env1 = json.loads((tmp_path / "replica1.log").read_text().strip().splitlines()[-1])
    assert env1[launch.ENV_LIGHTHOUSE] == "http://10.0.0.1:29510"
    assert env1[launch.ENV_INDEX] == "1" and env1[launch.ENV_NUM] == "2" and env1[launch.ENV_SEED] == "101"
    assert env1[launch.ENV_STOP_FILE] == str(tmp_path / "STOP")
    assert env1[launch.ENV_SYNC_LOG] == str(tmp_path / "replica1.sync.jsonl")
    assert launch.ENV_BARRIER not in env1  # external lighthouse: no start barrier


def test_group_index_offset_for_a_cluster_node(tmp_path):
    script = "import os; print(os.environ['COMPOSER_DILOCO_REPLICA_INDEX'], os.environ['COMPOSER_DILOCO_NUM_REPLICAS'])"
    g = launch.ReplicaGroup(
        [sys.executable, "-c", script], 2, lighthouse="127.0.0.1:1", log_dir=tmp_path, index_offset=2, total_replicas=4
    )
    with g:
        assert g.wait(timeout=60).ok
    assert (tmp_path / "replica3.log").read_text().strip().splitlines()[-1] == "3 4"
    with pytest.raises(launch.LaunchError, match="do not fit"):
        launch.ReplicaGroup(["x"], 2, index_offset=3, total_replicas=4)


def test_group_restarts_crashed_replica_up_to_max(tmp_path):
    g = launch.ReplicaGroup(
        [sys.executable, "-c", "import os, sys; sys.exit(0 if os.environ['COMPOSER_DILOCO_RESTART'] == '2' else 3)"],
        1,
        lighthouse="127.0.0.1:1",
        log_dir=tmp_path,
        max_restarts=2,
    )
    with g:
        res = g.wait(timeout=60)
    assert res.exit_codes == {0: [3, 3, 0]} and res.restarts == {0: 2} and res.ok


def test_group_gives_up_after_max_restarts(tmp_path):
    g = launch.ReplicaGroup(
        [sys.executable, "-c", "raise SystemExit(5)"], 1, lighthouse="127.0.0.1:1", log_dir=tmp_path, max_restarts=1
    )
    with g:
        res = g.wait(timeout=60)
    assert res.exit_codes == {0: [5, 5]} and not res.ok


def test_local_lighthouse_is_loopback_and_stopped(tmp_path):
    lh = launch.Lighthouse()
    try:
        assert lh.local and lh.address.startswith("http://127.0.0.1:")
    finally:
        lh.shutdown()
    ext = launch.Lighthouse("node7:29510")
    assert not ext.local and ext.address == "http://node7:29510"


def test_start_barrier_releases_when_all_arrive():
    import threading

    from composer_plugins.diloco.strategy import _wait_barrier

    b = launch.StartBarrier(3)
    done: list[float] = []
    ts = [
        threading.Thread(target=lambda i=i: (_wait_barrier(b.address, i, 30), done.append(time.monotonic())))
        for i in (0, 1)
    ]
    for t in ts:
        t.start()
    time.sleep(0.3)
    assert not done  # two of three arrived: still waiting
    t0 = time.monotonic()
    assert _wait_barrier(b.address, 2, 30) == {}
    for t in ts:
        t.join(10)
    assert len(done) == 2 and max(done) - t0 < 5  # released by the last arrival, not by the timeout


def test_start_barrier_learns_at_once_that_a_replica_exited(caplog):
    """The launcher marks a replica that died before arriving; the others go on at once, naming it."""
    from composer_plugins.diloco.strategy import _wait_barrier

    b = launch.StartBarrier(3, first=4)  # replicas 4, 5, 6 of a larger job
    b.mark_gone(6, "exited with code 7")
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="composer_plugins.diloco.strategy"):
        import threading

        t = threading.Thread(target=_wait_barrier, args=(b.address, 5, 60))
        t.start()
        assert _wait_barrier(b.address, 4, 60) == {6: "exited with code 7"}
        t.join(10)
    assert time.monotonic() - t0 < 10
    assert "replica 6 exited with code 7 before arriving" in caplog.text


def test_start_barrier_timeout_names_the_missing_replica(caplog):
    from composer_plugins.diloco.strategy import _wait_barrier

    b = launch.StartBarrier(2)
    with caplog.at_level("WARNING", logger="composer_plugins.diloco.strategy"):
        assert _wait_barrier(b.address, 0, 0.5) == {}
    assert "replica(s) [1] did not arrive within 0s" in caplog.text and "going on" in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_group_marks_a_dead_replica_gone_at_the_start_barrier(tmp_path):
    """End to end: replica 1 dies before the barrier; replica 0, waiting there, is told within seconds."""
    waiter = (
        "import json, os\nfrom composer_plugins.diloco.strategy import _wait_barrier\n"
        "gone = _wait_barrier(os.environ['COMPOSER_DILOCO_BARRIER'], 0, 300)\nprint(json.dumps(gone))\n"
    )
    argv = lambda i: [sys.executable, "-c", waiter if i == 0 else "raise SystemExit(7)"]  # noqa: E731
    g = launch.ReplicaGroup(argv, 2, lighthouse="127.0.0.1:1", barrier=True, log_dir=tmp_path, grace_s=2)
    with g:
        t0 = time.monotonic()
        res = g.wait(timeout=100)
        took = time.monotonic() - t0
    assert res.exit_codes == {0: [0], 1: [7]}
    assert (tmp_path / "replica0.log").read_text().strip().splitlines()[-1] == '{"1": "exited with code 7"}'
    assert took < 60  # not the 300 s barrier timeout


def test_group_fail_fast_names_the_dead_replica_and_stops_the_others(tmp_path):
    argv = lambda i: [  # noqa: E731
        sys.executable,
        "-c",
        "import time; time.sleep(120)"
        if i == 0
        else "import sys; print('replica one gives up', flush=True); sys.exit(3)",
    ]
    g = launch.ReplicaGroup(argv, 2, lighthouse="127.0.0.1:1", log_dir=tmp_path, grace_s=2)
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchError) as ei, g:
        pid0 = g.replicas[0].handle.pid
        g.wait(timeout=100, fail_fast=True)
    assert time.monotonic() - t0 < 30
    assert "replica 1 exited with code 3" in str(ei.value) and "replica one gives up" in str(ei.value)
    assert _gone([pid0])


def test_group_wait_timeout_names_the_running_replicas(tmp_path):
    argv = lambda i: [  # noqa: E731
        sys.executable,
        "-c",
        "import time; print('still busy', flush=True); time.sleep(120)" if i == 1 else "pass",
    ]
    g = launch.ReplicaGroup(argv, 2, lighthouse="127.0.0.1:1", log_dir=tmp_path, grace_s=2)
    with pytest.raises(launch.LaunchError) as ei, g:
        pid1 = g.replicas[1].handle.pid
        g.wait(timeout=3)
    msg = str(ei.value)
    assert f"replicas 1 (pid {pid1}) still running after 3s" in msg and "still busy" in msg
    assert _gone([pid1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_cleans_up(tmp_path, sig):
    """`kill <launcher>` and Ctrl-C terminate the replicas' process groups."""
    import subprocess

    code = (
        "from composer_plugins.diloco import launch\n"
        f"g = launch.ReplicaGroup({SLEEPER!r}, 2, lighthouse='127.0.0.1:1', log_dir={str(tmp_path)!r}, grace_s=2)\n"
        "with launch._sigterm_as_interrupt(), g:\n    g.wait()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        pids: list[int] = []
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [int(x) for x in os.popen(f"pgrep -P {p.pid}").read().split()]
            time.sleep(0.1)
        assert len(pids) == 2
        p.send_signal(sig)
        assert p.wait(30) != 0
        assert _gone(pids)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_replicas_die_with_a_killed_launcher(tmp_path):
    """Even a SIGKILLed launcher (no cleanup code runs) does not leave replicas behind."""
    import subprocess

    code = (
        "import sys, time\nfrom composer_plugins.diloco import launch\n"
        f"g = launch.ReplicaGroup({SLEEPER!r}, 2, lighthouse='127.0.0.1:1', log_dir={str(tmp_path)!r}).start()\n"
        "print(' '.join(str(r.handle.pid) for r in g.replicas), flush=True)\ntime.sleep(120)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    pids: list[int] = []
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(x) for x in pids)
        p.kill()
        p.wait(10)
        assert _gone(pids)
    finally:
        for x in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(x, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def test_cli_command_is_registered_and_documented():
    @click.group()
    def cli() -> None:
        pass

    from composer_plugins.diloco import plugin

    plugin.register_commands(cli)
    out = CliRunner().invoke(cli, ["diloco", "--help"])
    assert out.exit_code == 0, out.output
    for opt in ("--replicas", "--config", "--target", "--lighthouse", "--max-restarts", "STOP", "--executor"):
        assert opt in out.output


def test_replicas_default_from_config(tmp_path):
    from composer_plugins.diloco.run import check_replica_config

    p = tmp_path / "c.yaml"
    p.write_text("toy:\n  diloco:\n    replicas: 3\n")
    assert check_replica_config("toy", str(p), [], "toy").replicas == 3
    assert check_replica_config("toy", str(p), ["diloco.replicas=5"], "toy").replicas == 5
    assert check_replica_config("toy", None, []).replicas is None
    with pytest.raises(ConfigError, match="diloco.replicas"):
        check_replica_config("toy", str(p), ["diloco.replicas=0"], "toy")


@pytest.mark.slow
def test_restart_is_posted_on_the_rejoin_board_and_not_done_once_the_peers_finished(tmp_path):
    """A restarted replica is ``pending`` on the board its peers read; none is restarted with nobody left."""
    reader = (
        "import os, sys\n"
        "from composer_plugins.diloco.launch import RejoinBoard\n"
        "if os.environ['COMPOSER_DILOCO_RESTART'] == '0':\n"
        "    sys.exit(3)\n"
        "b = RejoinBoard.connect(os.environ['COMPOSER_DILOCO_REJOIN'])\n"
        "print('BOARD', b.state(1), b.outstanding([0, 1]), flush=True)\n"
    )
    argv = lambda i: [sys.executable, "-c", "import time; time.sleep(4)" if i == 0 else reader]  # noqa: E731
    g = launch.ReplicaGroup(argv, 2, log_dir=tmp_path / "a", max_restarts=1)
    with g:
        res = g.wait(timeout=120)
    assert res.exit_codes == {0: [0], 1: [3, 0]}, res
    assert "BOARD ('pending', 1, '') {1: 'pending'}" in (tmp_path / "a" / "replica1.log").read_text()

    # the peer has already finished when replica 1 fails: restarting it would leave it nobody to heal from
    argv = lambda i: [sys.executable, "-c", "pass" if i == 0 else "import time, sys; time.sleep(2); sys.exit(3)"]  # noqa: E731
    g = launch.ReplicaGroup(argv, 2, log_dir=tmp_path / "b", max_restarts=1)
    with g:
        res = g.wait(timeout=120)
    assert res.exit_codes == {0: [0], 1: [3]} and res.restarts == {0: 0, 1: 0}, res
