"""Checkpoints survive a kill while saving, and a resume from a missing or broken one fails at once, naming the
file, what is wrong and the previous good checkpoint (before any model is built)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands
from composer_plugins.training.lightning.checkpoints import (
    AtomicCheckpointIO,
    CheckpointError,
    checkpoint_problem,
    good_checkpoints,
    resolve_resume,
)


def _save(path: Path, value: float = 1.0) -> Path:
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.full((4,), value)}, "global_step": 1}, path)
    return path


@pytest.fixture
def ckdir(tmp_path) -> Path:
    d = tmp_path / "checkpoints"
    _save(d / "step=1.ckpt", 1.0)
    _save(d / "step=2.ckpt", 2.0)
    return d


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _truncated(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


@pytest.mark.parametrize(
    "make,problem",
    [
        (lambda d: d / "nope.ckpt", "does not exist"),
        (lambda d: _write(d / "empty.ckpt", b""), "is empty (0 bytes)"),
        (lambda d: _truncated(d / "step=2.ckpt", d / "last.ckpt"), "is truncated or corrupt"),
        (lambda d: _write(d / "last.ckpt", b"\x80\x04" + os.urandom(4096)), "is not a PyTorch checkpoint"),
        (lambda d: d, "is a directory"),
    ],
    ids=["missing", "empty", "truncated", "garbage", "directory"],
)
def test_checkpoint_problems_are_named(ckdir, make, problem):
    assert problem in (checkpoint_problem(make(ckdir)) or "")
    assert checkpoint_problem(ckdir / "step=2.ckpt") is None


def test_resume_last_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError) as e:
        resolve_resume("last", tmp_path / "checkpoints")
    msg = str(e.value)
    assert str(tmp_path / "checkpoints" / "last.ckpt") in msg and "does not exist" in msg
    assert "drop --resume to start a fresh run" in msg
    with pytest.raises(CheckpointError, match="writes no checkpoints"):
        resolve_resume("last", None)
    assert resolve_resume(None, tmp_path) is None


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty"])
def test_broken_last_offers_the_previous_good_checkpoint(ckdir, kind):
    last = ckdir / "last.ckpt"
    if kind == "truncated":
        _truncated(ckdir / "step=2.ckpt", last)
    elif kind == "garbage":
        last.write_bytes(b"\x80\x04not a zip at all" * 64)
    else:
        last.write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        resolve_resume("last", ckdir)
    msg = str(e.value)
    assert msg.startswith(f"{last}: ")
    assert f"resume from the previous good checkpoint: --resume {ckdir / 'step=2.ckpt'}" in msg
    # a path given directly gets the same check; its own directory is searched for a good one
    with pytest.raises(CheckpointError, match="previous good checkpoint"):
        resolve_resume(str(last), None)
    assert resolve_resume(str(ckdir / "step=1.ckpt"), None) == str(ckdir / "step=1.ckpt")
    assert good_checkpoints(ckdir) == [ckdir / "step=2.ckpt", ckdir / "step=1.ckpt"]


def test_cli_resume_fails_before_the_model_is_built(tmp_path):
    cfg = tmp_path / "run.yaml"
    # the model directory holds no model: had the model been built first, its error would come instead
    (tmp_path / "no-model").mkdir()
    cfg.write_text(f"output_dir: {tmp_path}/run\nmodel: {{name_or_path: {tmp_path}/no-model}}\n")
    cli = load_commands()
    r = CliRunner().invoke(cli, ["train", "-c", str(cfg), "--resume", "last"])
    assert r.exit_code != 0
    assert f"{tmp_path}/run/checkpoints/last.ckpt" in r.output and "does not exist" in r.output, r.output
    assert "Traceback" not in r.output
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"garbage" * 10)
    r = CliRunner().invoke(cli, ["train", "-c", str(cfg), "--resume", str(bad)])
    assert r.exit_code != 0 and f"{bad}: is not a PyTorch checkpoint" in r.output, r.output
    r = CliRunner().invoke(cli, ["train", "-c", str(cfg), "--resume", str(tmp_path / "missing.ckpt")])
    assert r.exit_code != 0 and "missing.ckpt: does not exist" in r.output, r.output


WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from composer_plugins.training.lightning.checkpoints import AtomicCheckpointIO
    io, last = AtomicCheckpointIO(), Path(sys.argv[1])
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "n": 0}, last)
    print("first", flush=True)
    big = torch.randn(48_000_000)  # ~190 MB: the save takes long enough to be killed inside it
    for n in range(1, 1000):
        io.save_checkpoint({"state_dict": {"w": big}, "n": n}, last)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_during_save_leaves_a_good_last_ckpt(tmp_path):
    last = tmp_path / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(last)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
        deadline = time.monotonic() + 120
        tmp = None
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = [p for p in last.parent.glob("last.ckpt.tmp-*") if p.stat().st_size > 1_000_000]
            if tmps:
                tmp = tmps[0]
                break
            time.sleep(0.01)
        assert tmp is not None, "the writer never got inside a save"
        os.kill(proc.pid, signal.SIGKILL)  # in the middle of writing ~190 MB
    finally:
        proc.kill()
        proc.wait(30)
    assert checkpoint_problem(last) is None  # the previous complete checkpoint, never a torn one
    assert torch.load(last, weights_only=False)["n"] >= 0
    assert resolve_resume("last", last.parent) == str(last)
    # the dead writer's temp file is removed by the next save into that directory
    assert list(last.parent.glob("*.tmp-*"))
    _save(last.parent / "step=9.ckpt")
    assert not list(last.parent.glob("*.tmp-*"))


def test_build_trainer_writes_checkpoints_atomically(tmp_path):
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.lightning.trainer import build_trainer

    cfg, _ = loads_train_config(f"output_dir: {tmp_path}/run\nmlflow: {{enabled: false}}\n")
    trainer = build_trainer(cfg, logger=False)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)


class _RunsCode:
    """An object whose unpickling runs code (here: creates a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _tampered(path: Path, marker: Path, state: dict | None = None) -> Path:
    """A checkpoint that passes every structural check but holds an object that runs code when unpickled."""
    AtomicCheckpointIO().save_checkpoint(
        {"state_dict": state or {"w": torch.ones(2)}, "global_step": 1, "hook": _RunsCode(marker)}, path
    )
    assert checkpoint_problem(path) is None
    return path


def test_a_checkpoint_that_would_run_code_is_refused_not_run(tmp_path):
    """Every local load is weights-only: resume (checked before Lightning reads it, whatever the strategy), the
    checkpoint IO, and the eval loader of policy weights. The code is never run, and the error names the file."""
    from composer_plugins.training.lightning.checkpoints import load_policy_weights

    marker = tmp_path / "ran"
    bad = _tampered(tmp_path / "checkpoints" / "last.ckpt", marker)
    with pytest.raises(CheckpointError, match=r"last\.ckpt: holds objects other than tensors.*drop --resume"):
        resolve_resume("last", bad.parent)
    with pytest.raises(CheckpointError, match=r"last\.ckpt: holds objects other than tensors"):
        AtomicCheckpointIO().load_checkpoint(str(bad))
    policy = torch.nn.Linear(3, 2)
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    evil = _tampered(tmp_path / "eval.ckpt", marker, state)
    with pytest.raises(CheckpointError, match=r"eval\.ckpt: holds objects other than tensors.*composer-plugins train"):
        load_policy_weights(policy, evil)
    assert not marker.exists()
    # what `composer-plugins train` writes (tensors, containers, numbers: RNG states as a tensor and lists) loads
    from composer_plugins.training.lightning.checkpoints import rng_state

    good = tmp_path / "good.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": state, "composer_rng": rng_state(), "global_step": 3}, good)
    assert resolve_resume(str(good), None) == str(good)
    assert AtomicCheckpointIO().load_checkpoint(str(good))["global_step"] == 3
    load_policy_weights(policy, good)


def test_a_ctrl_c_during_a_checkpoint_write_is_raised_after_the_write(tmp_path):
    """SIGINT arriving inside ``torch.save`` waits for the write: the checkpoint is whole, then KeyboardInterrupt."""
    import os
    import signal

    import torch

    from composer_plugins.training.lightning.checkpoints import AtomicCheckpointIO

    class Interrupting:
        """A checkpoint value whose pickling sends this process SIGINT (Ctrl-C mid-write)."""

        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGINT)
            return (dict, ())

    path = tmp_path / "step=3.ckpt"
    # Python's own Ctrl-C handler, as in a terminal (a test run started as a shell background job ignores SIGINT)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            AtomicCheckpointIO().save_checkpoint({"w": torch.arange(4.0), "x": Interrupting()}, path)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)
    whole = torch.load(path, weights_only=False)  # the test's own file (its stand-in value is a plain dict)
    assert torch.equal(whole["w"], torch.arange(4.0)) and whole["x"] == {}
