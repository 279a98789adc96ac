"""The ``monarch`` backend: Generator, Rewarder and Trainer actors on a Monarch process mesh.

One training step, driven by :class:`MonarchBackend` from the client process:

1. the :class:`RewarderActor` (owns the env) draws the step's seeded tasks;
2. the :class:`GeneratorActor` mesh (``generators`` processes; each samples its shard of the
   prompts with HF ``generate``) returns the rollout;
3. the :class:`RewarderActor` scores the completions with the env plugin (``env.reward``);
4. the :class:`TrainerActor` holds the step's components
   (:meth:`~composer_plugins.training.step.components.StepComponents.from_config`, as the Lightning module's): it makes
   the step's read-only record with the one experience maker (group advantages, hinted contexts, teacher scoring
   started), computes the composed loss with the one step computer and takes the one local optimizer step
   (:meth:`~composer_plugins.training.step.components.StepComponents.optimize`, which counts the steps);
5. the trainer's new weights are sent back to every generator (``load_weights``).

Every actor runs in its own OS process of a local process mesh
(``this_host().spawn_procs(per_host={"gpus": n})`` works on CPU); actor failures surface in
the client as ``monarch.actor.ActorError``. Tested with torchmonarch 0.7.0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from monarch.actor import Actor, ActorError, current_rank, current_size, endpoint, this_host
from torch import Tensor

from composer_plugins.backends.surface import Backend, Rollout, Sampler, refuse_own_sampling, scalar_metrics
from composer_plugins.backends.surface import StepComponents as _StepComponents  # noqa: F401
from composer_plugins.backends.surface import rollout as _rollout  # noqa: F401  (imported here, once: see _INIT_LOCK)
from composer_plugins.backends.surface import run_train as _run_train  # noqa: F401

#: Actors placed in the same process are constructed concurrently; their (lazy) imports of
#: lightning/transformers modules must not interleave (Python raises _DeadlockError), so the
#: heavy modules are imported above and every actor's __init__ holds this lock.
_INIT_LOCK = threading.Lock()

__all__ = [
    "ActorError",
    "GeneratorActor",
    "MonarchBackend",
    "MonarchSession",
    "RewarderActor",
    "TrainerActor",
    "merge_rollouts",
]


def _config(config: Mapping[str, Any]) -> Any:
    from composer_plugins.backends.surface import train_config_from_dict

    return train_config_from_dict(config)


def _threads(cfg: Any) -> None:
    torch.set_num_threads(int(cfg.trainer.num_threads or 1))


#: What a rollout carries between actors: the :class:`Rollout`'s own fields, read from its annotations, but the
#: group layout (rebuilt from ``num_generations``) and the extras.
_WIRE = tuple(f.name for f in dataclasses.fields(Rollout) if f.name not in ("group_index", "extra"))


def _rollout_to_wire(ro: Any) -> dict[str, Any]:
    out = {k: getattr(ro, k) for k in _WIRE}
    return {
        k: v.cpu() if isinstance(v, Tensor) else list(v) if isinstance(v, list | tuple) else v for k, v in out.items()
    }


def merge_rollouts(
    parts: Sequence[Mapping[str, Any]], pad_id: int, tasks: Sequence[Sequence[Mapping[str, Any]]] | None = None
) -> Any:
    """The wire rollouts (in order) as one rollout record, by the record's row operation
    (:meth:`~composer_plugins.training.step.record.StepRecord.concat`: prompts re-left-padded, completions
    re-right-padded).
    ``tasks``: each part's tasks (its rows answer them); the record holds no scores: the trainer's experience
    maker makes the step's record."""
    from composer_plugins.backends.surface import StepRecord

    per_part = list(tasks) if tasks is not None else [()] * len(parts)
    recs = [
        StepRecord.from_rollout(t, _rollout_from_wire(p))
        for p, t in zip(parts, per_part, strict=True)
        if p["completion_ids"].shape[0]
    ]
    return StepRecord.concat(recs, pad_id=pad_id)


def _rollout_from_wire(w: Mapping[str, Any]) -> Any:
    G, n = int(w["num_generations"]), w["completion_ids"].shape[0]
    return Rollout(**{k: w[k] for k in _WIRE}, group_index=torch.arange(n // G).repeat_interleave(G))


class GeneratorActor(Actor):
    """Holds a copy of the policy and samples completions for its shard of the prompts."""

    def __init__(self, config: dict[str, Any], model_dir: str) -> None:
        from composer_plugins.backends.surface import load_policy

        with _INIT_LOCK:
            self.cfg = _config(config)
            _threads(self.cfg)
            self.policy, self.tokenizer = load_policy(model_dir, dtype=self.cfg.model.dtype)
            self.policy.eval()
            self.version = 0
            self.sampler = Sampler.from_config(self.cfg)

    @endpoint
    async def generate(self, prompts: list[str], seed: int) -> dict[str, Any]:
        """Sample ``G`` completions for prompts ``rank::size`` (this replica's shard)."""
        rank, size = current_rank().rank, _mesh_size()
        mine = prompts[rank::size]
        if not mine:
            return {"completion_ids": torch.zeros(0, 0, dtype=torch.long), "rank": rank}
        ro = self.sampler.generate(self.policy, self.tokenizer, mine, seed * 1009 + rank)
        return {**_rollout_to_wire(ro), "rank": rank, "version": self.version, "pid": os.getpid()}

    @endpoint
    async def load_weights(self, weights: dict[str, Tensor], version: int) -> int:
        """Replace the policy weights with the trainer's; returns the new version."""
        from composer_plugins.backends.surface import load_weights

        load_weights(self.policy, weights)
        self.version = int(version)
        return self.version

    @endpoint
    async def checksum(self) -> float:
        """Sum of all weights (to check generators and trainer agree)."""
        return float(sum(p.detach().double().sum() for p in self.policy.parameters()))


def _mesh_size() -> int:
    size = 1
    for n in current_size().values():
        size *= int(n)
    return size


class RewarderActor(Actor):
    """Owns the env plugin: draws the seeded tasks of each step and scores completions with ``env.reward``."""

    def __init__(self, config: dict[str, Any]) -> None:
        from composer_plugins.backends.surface import build_env, task_drawer

        with _INIT_LOCK:
            self.cfg = _config(config)
            _threads(self.cfg)
            self.env = build_env(self.cfg)
            self.draw = task_drawer(self.env, self.cfg, "train")

    @endpoint
    async def tasks(self, step: int) -> list[dict[str, Any]]:
        """The tasks of ``step`` (seeded by ``config.seed`` and ``step``)."""
        from composer_plugins.backends.surface import derive_seed

        return [dict(t) for t in self.draw(self.cfg.rollout.prompts_per_step, derive_seed(self.cfg.seed, 0, step))]

    @endpoint
    async def score(self, tasks: list[dict[str, Any]], completions: list[str]) -> list[float]:
        """``env.reward`` of each completion (``G`` per task, in order)."""
        from composer_plugins.backends.surface import env_rewards

        return env_rewards(self.env, tasks, completions, self.cfg.rollout.num_generations)


class TrainerActor(Actor):
    """Applies the composed loss to a received rollout and steps the optimizer; serves its weights."""

    def __init__(self, config: dict[str, Any], model_dir: str) -> None:
        from composer_plugins.backends.surface import StepComponents, load_policy

        with _INIT_LOCK:
            self.cfg = _config(config)
            _threads(self.cfg)
            torch.manual_seed(self.cfg.seed)
            policy, tok = load_policy(model_dir, dtype=self.cfg.model.dtype)
            #: The step's components, from the one path from config (they count the steps they take).
            self.parts = StepComponents.from_config(self.cfg, policy=policy, tokenizer=tok)

    def _loss(self, tasks: list[dict[str, Any]], ro: Any, rewards: list[float], seed: int) -> tuple[Tensor, dict, Any]:
        # the native step on the rollout we were sent: the experience maker's record, then the step computer
        record = self.parts.experience.make(tasks, ro, rewards)
        return (*self.parts.loss_on(record, seed), record)

    @endpoint
    async def train_step(
        self, tasks: list[dict[str, Any]], rollout: dict[str, Any], rewards: list[float], step: int
    ) -> dict[str, float]:
        """One optimizer step of the composed loss on ``rollout``; returns the step's statistics."""
        from composer_plugins.backends.surface import derive_seed

        t0 = time.perf_counter()
        loss, stats, _ = self._loss(tasks, _rollout_from_wire(rollout), rewards, derive_seed(self.cfg.seed, 1, step))
        norm = self.parts.optimize(loss)  # the components' optimizer step (and EMA teacher update)
        out = scalar_metrics(stats)
        out.update(
            loss=float(loss.detach()),
            grad_norm=float(norm),
            trainer_step_time=time.perf_counter() - t0,
            trainer_pid=float(os.getpid()),
            record_step=float(self.parts.last_meta.step),
        )
        return out

    @endpoint
    async def weights(self) -> dict[str, Tensor]:
        """A CPU copy of the policy weights (sent to the generators)."""
        from composer_plugins.backends.surface import state_dict_cpu

        return state_dict_cpu(self.parts.policy)

    @endpoint
    async def checksum(self) -> float:
        """Sum of all weights."""
        return float(sum(p.detach().double().sum() for p in self.parts.policy.parameters()))

    @endpoint
    async def save(self, path: str) -> str:
        """``save_pretrained`` the policy and tokenizer to ``path``."""
        self.parts.policy.save_pretrained(path)
        self.parts.tokenizer.save_pretrained(path)
        return path


class MonarchBackend(Backend):
    """Train the config's channels with Generator / Rewarder / Trainer actors on a local Monarch mesh.

    Args:
        config, overrides, output_dir: see :class:`~composer_plugins.backends.base.Backend`.
        generators: processes of the mesh; a generator replica runs on each (each samples a shard of
            the step's prompts).
        colocate: ``True`` (default) places the rewarder on the first and the trainer on the last
            process of that mesh (fewest processes); ``False`` gives each its own one-process mesh.
        max_steps: overrides ``trainer.max_steps``.
    """

    name = "monarch"
    upstream = "torchmonarch>=0.7,<0.8"
    runs_here = "the three actor roles in separate processes of a local CPU process mesh, real training steps"
    needs_gpu = "nothing; on GPU hosts the same actors run with per_host={'gpus': N} and CUDA policies"
    support: ClassVar[dict[str, Any]] = {"monarch": None}

    def __init__(
        self,
        config: Any = None,
        overrides: Sequence[str] = (),
        *,
        output_dir: str | None = None,
        generators: int = 2,
        colocate: bool = True,
        max_steps: int | None = None,
    ) -> None:
        super().__init__(config, overrides, output_dir=output_dir, max_steps=max_steps)
        # the generators sample through the one Sampler (rollout.compile), the trainer steps the one optimizer
        where = "the monarch backend (generator actors, each with a policy copy)"
        refuse_own_sampling(self.config, self.src, where, honours=("rollout.compile", "optim.fused"))
        self.generators = max(1, int(generators))
        self.colocate = bool(colocate)

    def session(self) -> MonarchSession:
        """An async context manager holding the spawned meshes (``async with backend.session() as s``)."""
        return MonarchSession(self)

    def train(self) -> Any:
        """Run the actor loop; returns a :class:`~composer_plugins.training.runs.run.RunResult`."""
        return asyncio.run(self.run())

    async def run(self) -> Any:
        """The actor loop (async; use :meth:`train` from synchronous code)."""
        async with self.session() as s:
            for step in range(self.config.trainer.max_steps):
                await s.step(step)
            return await s.finish()


class MonarchSession:
    """Spawned actors of one :class:`MonarchBackend` run; :meth:`step` runs one training step."""

    def __init__(self, backend: MonarchBackend) -> None:
        self.backend = backend
        self.history: list[dict[str, float]] = []
        self._meshes: list[Any] = []

    async def __aenter__(self) -> MonarchSession:
        from composer_plugins.backends.surface import load_policy, resolve_policy, to_dict

        b = self.backend
        model_dir = resolve_policy(b.config)  # base / SFT warm start, built once here, loaded by every actor
        wire = to_dict(b.config)
        host = this_host()
        procs = host.spawn_procs(per_host={"gpus": b.generators})
        self._meshes.append(procs)
        if b.colocate:
            rew_procs, trn_procs = procs.slice(gpus=0), procs.slice(gpus=b.generators - 1)
        else:
            rew_procs, trn_procs = host.spawn_procs(per_host={"gpus": 1}), host.spawn_procs(per_host={"gpus": 1})
            self._meshes += [rew_procs, trn_procs]
        self.generators = procs.spawn("generator", GeneratorActor, wire, model_dir)
        self.rewarder = rew_procs.spawn("rewarder", RewarderActor, wire)
        self.trainer = trn_procs.spawn("trainer", TrainerActor, wire, model_dir)
        from composer_plugins.backends.surface import install_chat_template

        tok = self.tokenizer = install_chat_template(load_policy(model_dir)[1], b.config.model.chat_template)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for pm in self._meshes:
            try:
                await pm.stop()
            except Exception:  # pragma: no cover - best-effort shutdown
                pass

    async def step(self, step: int) -> dict[str, float]:
        """Tasks (rewarder) -> rollout (generators) -> rewards (rewarder) -> update (trainer) -> weights back."""
        from composer_plugins.backends.surface import derive_seed, task_prompt

        c = self.backend.config
        t0 = time.perf_counter()
        tasks = await self.rewarder.tasks.call_one(step)
        prompts = [task_prompt(t, self.tokenizer, c.model.chat_template) for t in tasks]  # the text the model reads
        shards = await self.generators.generate.call(prompts, derive_seed(c.seed, 1, step))
        ordered = sorted((v for _, v in shards.items()), key=lambda sh: sh["rank"])
        rollout = _interleave(ordered, len(prompts), self.pad, tasks)
        rewards = await self.rewarder.score.call_one(tasks, rollout["completions"])
        stats = await self.trainer.train_step.call_one(tasks, rollout, rewards, step)
        weights = await self.trainer.weights.call_one()
        await self.generators.load_weights.call(weights, step + 1)
        scored = [r for r in rewards if r == r]  # unscorable completions (NaN) are left out of the mean
        row = {"step": float(step + 1), "reward": sum(scored) / len(scored) if scored else float("nan"), **stats}
        row["generator_pids"] = float(len({sh.get("pid") for sh in ordered if "pid" in sh}))
        row["step_time"] = time.perf_counter() - t0
        self.history.append(row)
        return row

    async def finish(self) -> Any:
        """Save the trainer's policy, check the generators hold the same weights, write the outputs."""
        b = self.backend
        await self.trainer.save.call_one(str(b.output_dir / "model"))
        trainer_sum = await self.trainer.checksum.call_one()
        gen_sums = [v for _, v in (await self.generators.checksum.call()).items()]
        tol = 1e-6 * max(1.0, abs(trainer_sum))
        in_sync = float(all(abs(g - trainer_sum) <= tol for g in gen_sums))
        return b.write_outputs(
            self.history, {"monarch/trainer_checksum": trainer_sum, "monarch/generators_in_sync": in_sync}
        )


def _interleave(
    shards: Sequence[Mapping[str, Any]], n_prompts: int, pad: int, tasks: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """Undo the ``rank::size`` sharding with the record's row operations: the shards concatenated
    (:func:`merge_rollouts`, shard ``r`` answering ``tasks[r::size]``), then their rows selected back in prompt
    order (``G`` rows per prompt)."""
    size = len(shards)
    merged = merge_rollouts(shards, pad, [tasks[r::size] for r in range(size)] if tasks is not None else None)
    G = merged.num_generations
    # row blocks of G per prompt; shard r holds prompts r, r+size, ...
    starts, acc = [], 0
    for s in shards:
        starts.append(acc)
        acc += s["completion_ids"].shape[0]
    order: list[int] = []
    for p in range(n_prompts):
        base = starts[p % size] + (p // size) * G
        order.extend(range(base, base + G))
    return _rollout_to_wire(merged.select(order))
