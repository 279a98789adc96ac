"""Checkpoints that survive a kill, and a resume that says what is wrong before anything is built.

:class:`AtomicCheckpointIO` writes to a temporary file and renames it over the target, so a kill never leaves
a half-written checkpoint; :func:`checkpoint_problem` says what is wrong with a ``.ckpt`` without unpickling
it; :func:`resolve_resume` checks ``--resume``; :func:`safe_load` reads with ``weights_only=True``, so a
checkpoint never runs code. See docs/training.md "Trainer, checkpoints and exact resume".
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import signal
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.core.io import atomic_file
from composer_plugins.training.config.inputs import checkpoint_step

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "checkpoint_problem",
    "good_checkpoints",
    "load_policy_weights",
    "resolve_resume",
    "rng_state",
    "safe_load",
    "set_rng_state",
]

TMP_MARK = ".tmp-"


class CheckpointError(ComposerPluginsError, ValueError):
    """A checkpoint to resume from is missing or unreadable; the message names it and the fix."""


def checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """``None`` if ``path`` looks like a complete PyTorch checkpoint, else what is wrong with it (a phrase).

    ``torch.save`` writes a zip archive (``<name>/data.pkl`` plus tensor records); this checks that the
    archive is complete (its end record is there) and that every member's CRC matches, which reads the
    file once but unpickles nothing.
    """
    p = Path(path)
    if not p.exists():
        return "does not exist"
    if p.is_dir():
        return "is a directory, not a checkpoint file"
    size = p.stat().st_size
    if size == 0:
        return "is empty (0 bytes): the run was killed while writing it"
    with open(p, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04":
        return f"is not a PyTorch checkpoint (it starts with {head!r}, not a zip archive)"
    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
                return "is a zip archive without data.pkl, not a PyTorch checkpoint"
            bad = z.testzip()
            if bad is not None:
                return f"is corrupt: member {bad!r} fails its CRC check"
    except zipfile.BadZipFile:
        return f"is truncated or corrupt ({size} bytes; the zip archive is incomplete)"
    except (OSError, EOFError, RuntimeError, ValueError) as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    return None


def good_checkpoints(directory: str | os.PathLike[str], exclude: str | os.PathLike[str] | None = None) -> list[Path]:
    """The complete ``.ckpt`` files in ``directory``, newest first (by step in the name, then mtime)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    ex = Path(exclude).resolve() if exclude is not None else None
    found = [p for p in d.glob("*.ckpt") if p.is_file() and p.resolve() != ex and checkpoint_problem(p) is None]
    return sorted(found, key=lambda p: (checkpoint_step(p), p.stat().st_mtime), reverse=True)


def _offer(bad: Path, directory: Path | None) -> str:
    where = directory if directory is not None else bad.parent
    good = good_checkpoints(where, exclude=bad)
    if good:
        return f"resume from the previous good checkpoint: --resume {good[0]}"
    return f"no good checkpoint in {where}; drop --resume to start a fresh run"


def resolve_resume(resume: str | os.PathLike[str] | None, checkpoint_dir: str | os.PathLike[str] | None) -> str | None:
    """The checked checkpoint path to resume from (``None``: no resume asked for).

    ``resume="last"`` means ``<checkpoint_dir>/last.ckpt``; it must exist (no silent fresh start).
    Any problem raises :class:`CheckpointError` in the form ``<file>: <what is wrong> — <fix>``.
    """
    if resume is None or str(resume) == "":
        return None
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if str(resume) == "last":
        if directory is None:
            raise CheckpointError(
                "--resume last: this run writes no checkpoints (trainer.checkpoint_every_n_steps is 0) — pass "
                "--resume PATH/TO/FILE.ckpt, or drop --resume to start a fresh run"
            )
        path = directory / "last.ckpt"
        if not path.exists():
            others = good_checkpoints(directory)
            fix = f"resume from --resume {others[0]}" if others else "drop --resume to start a fresh run"
            raise CheckpointError(f"{path}: --resume last: no checkpoint to resume from (it does not exist) — {fix}")
    else:
        path = Path(resume)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem} — {_offer(path, directory if str(resume) == 'last' else None)}")
    safe_load(path, mmap=True)  # nothing but tensors and plain data in it (tensor bytes are not read)
    return str(path)


def safe_load(
    path: str | os.PathLike[str],
    *,
    mmap: bool = False,
    fix: str = "resume from a checkpoint written by `composer-plugins train`, or drop --resume to start a fresh run",
) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU: a checkpoint holding anything but tensors and plain
    data (an object whose unpickling would run code) raises a :class:`CheckpointError` naming the file and
    what it holds, instead of being executed."""

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        what = str(e).strip().splitlines()
        detail = next((ln.strip() for ln in what if "GLOBAL" in ln or "Unsupported" in ln), what[0] if what else "")
        raise CheckpointError(
            f"{path}: holds objects other than tensors and plain data, which are not loaded (a weights-only "
            f"load refused it: {detail}) — {fix}"
        ) from None


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that never leaves a partly written checkpoint: temp file, fsync, rename; and reads
    one with a loader that runs no code (:func:`safe_load`)."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(f"{type(self).__name__} reads checkpoints weights-only; weights_only=False was asked for")
        if map_location is None and isinstance(path, str | os.PathLike):
            return safe_load(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_temps(target.parent)
        with _sigint_deferred(), atomic_file(target, "wb", tmp_name=f"{target.name}{TMP_MARK}{os.getpid()}") as f:
            torch.save(checkpoint, f)


@contextlib.contextmanager
def _sigint_deferred() -> Any:
    """Hold a Ctrl-C (SIGINT) that arrives during a checkpoint write until the write is done, then raise it.

    Interrupted inside ``torch.save``, the zip writer fails on its way out with an unrelated ``RuntimeError`` that
    hides the ``KeyboardInterrupt`` (exit 1, no "interrupted at step N" message). Outside the main thread
    (where signal handlers cannot be set) the write runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
    elif caught and previous == signal.SIG_DFL:
        raise KeyboardInterrupt


def _remove_dead_temps(directory: Path) -> None:
    """Remove ``*.ckpt.tmp-<pid>`` files whose writer process is gone (killed during a save)."""
    for p in directory.glob(f"*.ckpt{TMP_MARK}*"):
        pid = p.name.rsplit(TMP_MARK, 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                p.unlink()
        except PermissionError:
            pass


def rng_state() -> dict[str, Any]:
    """The torch, Python and NumPy global RNG states as plain data (for a checkpoint)."""

    np_state = np.random.get_state()
    py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def set_rng_state(state: Any) -> None:
    """Restore what :func:`rng_state` returned."""

    torch.set_rng_state(state["torch"])
    v, s, g = state["python"]
    random.setstate((v, tuple(s), g))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))


def load_policy_weights(policy: Any, path: str | os.PathLike[str]) -> None:
    """Load the policy weights of a ``ComposerModule`` Lightning checkpoint into ``policy``, strictly.

    A checkpoint whose ``policy.*`` weights do not fit ``policy`` (keys missing or unexpected, shapes that
    differ) raises a :class:`CheckpointError` naming the file and the first offending keys, instead of
    loading part of it.
    """
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem} — give a .ckpt written by `composer-plugins train`")
    ckpt = safe_load(path, fix="give a .ckpt written by `composer-plugins train`")
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path}: not a Lightning checkpoint (no state_dict) — give a .ckpt written by "
            "`composer-plugins train`, or a save_pretrained directory"
        )
    weights = {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
    own = policy.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = sorted(k for k in set(own) & set(weights) if tuple(own[k].shape) != tuple(weights[k].shape))
    if missing or unexpected or shapes:
        parts = []
        for what, keys in (("missing", missing), ("unexpected", unexpected)):
            if keys:
                more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
                parts.append(f"{what} {', '.join(keys[:3])}{more}")
        parts += [
            f"{k}: {tuple(weights[k].shape)} in the checkpoint, {tuple(own[k].shape)} in the model" for k in shapes[:3]
        ]
        raise CheckpointError(
            f"{path} does not fit the configured model ({'; '.join(parts)}) — evaluate it with "
            "the config it was trained with (its model section and model.name_or_path)"
        )
    policy.load_state_dict(weights, strict=True)
