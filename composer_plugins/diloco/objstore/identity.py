"""Who the run is: ``run.json`` (its id, replicas, parameter shapes and every setting its replicas must share),
claimed by the first replica, checked by every other; a prefix holding another run's objects is refused."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from composer_plugins.core.errors import ConfigError, one_line
from composer_plugins.diloco.objstore.rounds import _UNNAMED, ForeignObjectError
from composer_plugins.diloco.store import CorruptObjectError, pack, unpack


class RunIdentityMixin:
    """The run directory's identity checks of :class:`~composer_plugins.diloco.objstore.ObjectStoreDiLoCoCallback`
    (its ``store``, ``run_id``, ``replica``, ``config``, ``params`` and optimizers)."""

    def _probe_conditional_create(self) -> None:
        """Refuse a store that does not honour If-None-Match: the round manifest depends on it."""
        key = f"probe/{self.replica.index}-{os.urandom(6).hex()}"
        first = self.store.put(key, b"probe", create=True)
        second = self.store.put(key, b"probe", create=True)
        self.store.delete(key)
        if not first or second:
            raise ConfigError(
                f"{self.store.where} does not honour conditional creates (If-None-Match: *): two "
                "creates of one key both succeeded. DiLoCo's round manifest needs them. HINT: use S3, "
                "GCS, Azure, R2 or a file:// store, or a server version that supports them.",
                key="diloco.store",
            )

    def _run_identity(self) -> dict[str, Any]:
        """What ``run.json`` pins: who the run is and every setting its replicas must share (JSON values)."""
        shapes = [list(p.shape) for p in self.params]
        mine = {
            "run_id": self.run_id,
            "num_replicas": self.replica.num_replicas,
            "sync_every": self.config.sync_every,
            "compress": self.config.compress,
            **(
                {"state_every": self.config.state_every, "exact_every": self.config.exact_every}
                if self._replay_points()
                else {}
            ),
            "param_shapes": shapes,
            "outer_optimizer": optimizer_settings(self.outer_optimizers[0]),
            "inner_optimizer": optimizer_settings(self._inner),
        }
        return json.loads(json.dumps(mine))

    def _check_run(self) -> None:
        """Claim the run directory (``run.json``) or check that it holds this run with this replica's settings;
        refuse another run's, and a prefix holding another run's objects whose ``run.json`` is gone."""
        mine = self._run_identity()
        if self.store.put("run.json", pack({"kind": "run"}, json.dumps(mine).encode()), create=True):
            self._refuse_leftovers()
        data = self.store.get("run.json")
        try:
            header, body = unpack(data or b"", f"{self.store.where}/run.json")
            theirs = json.loads(body)
            if header.get("kind") != "run" or not isinstance(theirs, dict):
                raise CorruptObjectError(f"{self.store.where}/run.json: not a run description")
        except (CorruptObjectError, ValueError) as e:
            raise ConfigError(
                f"{self.store.where}/run.json: {one_line(e)}: the run directory is damaged (refused; "
                "nothing in it was run). HINT: point diloco.store at a fresh prefix.",
                key="diloco.store",
            ) from e
        # a run with replay points pins state_every and exact_every: a replica without them is refused too
        pinned = [*mine, *(k for k in ("state_every", "exact_every") if k in theirs and k not in mine)]
        diff = [k for k in pinned if theirs.get(k) != mine.get(k)]
        if not diff:
            return
        if "run_id" in diff or "param_shapes" in diff:
            what = ", ".join(
                f"{k}: {theirs.get(k)!r} there, {mine[k]!r} here"
                for k in diff
                if k in ("run_id", "num_replicas", "sync_every", "compress")
            )
            if "param_shapes" in diff:
                what += ("; " if what else "") + "another model (parameter shapes differ)"
            resume = (
                f" To continue that run, pass --run-id {theirs.get('run_id')} (diloco.run_id) with its settings."
                if diff == ["run_id"]
                else ""
            )
            raise ConfigError(
                f"{self.store.where} holds another run ({what}). HINT: give this run a fresh prefix, e.g. "
                f"diloco.store={self.store.where.rsplit('/', 1)[0]}/<new-run>, or delete the old one.{resume}",
                key="diloco.store",
            )
        settings = []
        for k in diff:
            a, b = theirs.get(k), mine.get(k)
            if isinstance(a, dict) and isinstance(b, dict):
                settings += [
                    f"{k}.{f} is {a.get(f, '(unset)')!r} in the run, {b.get(f, '(unset)')!r} here"
                    for f in sorted(set(a) | set(b))
                    if a.get(f) != b.get(f)
                ]
            else:
                settings.append(f"{k} is {a!r} in the run, {b!r} here")
        fix = {  # the rest: diloco.<key>
            "num_replicas": "--replicas / --total-replicas",
            "outer_optimizer": "diloco.outer_lr, diloco.outer_momentum, diloco.outer_nesterov "
            "or diloco.outer_optimizer",
            "inner_optimizer": "the training config's optimizer (its learning rate "
            "and hyper-parameters; a replica joining before round 0 would otherwise take the run's)",
        }
        fixes = "; ".join(fix.get(k, f"diloco.{k}") for k in diff)
        raise ConfigError(
            f"this replica's settings differ from those of run {theirs.get('run_id')!r} "
            f"({self.store.where}/run.json): {'; '.join(settings)}. Every replica of a run must share them (the "
            f"outer step and the pseudo-gradients are only the same computation with the same settings). HINT: set "
            f"{fixes} to the run's values, or start another run on a fresh prefix.",
            key="diloco.store",
        )

    def _refuse_leftovers(self) -> None:
        """This replica just created ``run.json``: refuse (and take it back) if the prefix already holds another
        run's objects (a lifecycle rule that deleted the oldest object first leaves states without their run)."""
        for sub in ("init", "state", "rounds"):
            keys = (["init"] if self.store.exists("init") else []) if sub == "init" else self.store.list(sub)
            keys = [k for k in keys if not _UNNAMED.search(k)]  # the newest that names its run is looked at
            if keys:
                key = sorted(keys)[-1]
                try:
                    data = self.store.get(key)
                    theirs = unpack(data, f"{self.store.where}/{key}")[0].get("run") if data else None
                except (CorruptObjectError, ValueError):
                    theirs = "(unreadable)"
                if theirs == self.run_id:  # this run's own objects (its run.json was lost): it continues
                    continue
                self.store.delete("run.json")
                raise ForeignObjectError(
                    f"{self.store.where}/{key} (the prefix has no run.json: this run was about to claim it)",
                    theirs,
                    self.run_id,
                )


#: optimizer ``param_groups`` keys that choose an implementation, not the update (they may differ by device)
_IMPLEMENTATION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "initial_lr"})


def optimizer_settings(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What an optimizer computes, as JSON values: its class and each parameter group's hyper-parameters (``lr``:
    the ``initial_lr`` a scheduler started from, if any), group ``g > 0``'s prefixed ``group<g>.``."""
    out: dict[str, Any] = {"class": f"{type(opt).__module__}.{type(opt).__qualname__}"}
    for g, group in enumerate(opt.param_groups):
        prefix = f"group{g}." if g else ""
        for k, v in sorted(group.items()):
            if k in _IMPLEMENTATION_KEYS:
                continue
            if k == "lr" and "initial_lr" in group:
                v = group["initial_lr"]
            out[prefix + k] = _json_value(v)
    return out


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)
