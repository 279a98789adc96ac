"""Conformance of rollout generators (registry kind ``rollout_generators``), built-in or third-party.

:func:`check_generator` builds the entry through the registry, as ``rollout.generator`` does, and runs it on
a tiny local chat model (or the ``model_path`` it is given: the model a server generator's server serves);
each check is listed in docs/plugins.md ("rollout_generators").
"""

from __future__ import annotations

import functools
import math
from typing import Any

from composer_plugins.testing.base import _build, _entry, _fail

__all__ = ["check_generator"]

#: The sampling settings of the check (a short completion: the check runs on the CPU in a second or two).
SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 6, "max_prompt_length": 64}
PROMPTS = ("What is 2 + 3?", "What is 7 - 4?")
G = 2


@functools.lru_cache(maxsize=4)
def _policy(model_path: str | None) -> tuple[Any, Any]:
    """``(policy, tokenizer)`` of ``model_path``, or of a tiny chat model built once per process."""
    import tempfile

    from composer_plugins.models.tiny import load_policy
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    if model_path is None:
        model_path = str(build_tiny_chat_model(tempfile.mkdtemp(prefix="generator_check_") + "/model"))
    policy, tok = load_policy(model_path)
    return policy.eval(), tok


def _rows(ro: Any) -> list[list[int]]:
    return [ro.completion_ids[j][ro.completion_mask[j].bool()].tolist() for j in range(ro.completion_ids.shape[0])]


def _check_rollout(entry: Any, ro: Any, n: int, what: str, device: Any, max_new: int | None) -> None:
    """The shape contract of a :class:`Rollout` of ``n`` prompts × :data:`G` rows."""
    import torch

    from composer_plugins.models.generation import Rollout

    if not isinstance(ro, Rollout):
        raise _fail(entry, f"{what} returned a {type(ro).__name__}, not a composer_plugins.models.generation.Rollout")
    rows = n * G
    shapes = {
        k: tuple(getattr(ro, k).shape) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    }
    if any(len(s) != 2 or s[0] != rows for s in shapes.values()):
        raise _fail(entry, f"{what}: {n} prompts × G={G} need {rows} rows of 2-d ids and masks, got {shapes}")
    if shapes["prompt_ids"] != shapes["prompt_mask"] or shapes["completion_ids"] != shapes["completion_mask"]:
        raise _fail(entry, f"{what}: each mask must have its ids' shape, got {shapes}")
    for k in ("prompt_mask", "completion_mask"):
        m = getattr(ro, k)
        if not bool(((m == 0) | (m == 1)).all()):
            raise _fail(entry, f"{what}: {k} holds values other than 0 and 1")
    if not bool((ro.prompt_mask.sum(1) > 0).all()):
        raise _fail(entry, f"{what}: a row has no real prompt token (prompt_mask all 0)")
    if max_new is not None and int(ro.completion_mask.sum(1).max()) > max_new:
        raise _fail(entry, f"{what}: a completion is longer than max_new_tokens={max_new}")
    if len(ro.completions) != rows or not all(isinstance(c, str) for c in ro.completions):
        raise _fail(entry, f"{what}: completions must be {rows} strings, got {len(ro.completions)}")
    if len(ro.prompts) != rows:
        raise _fail(entry, f"{what}: prompts must hold one text per row ({rows}), got {len(ro.prompts)}")
    want = torch.arange(n).repeat_interleave(G)
    if ro.num_generations != G or ro.group_index.cpu().tolist() != want.tolist():
        raise _fail(
            entry,
            f"{what}: rows [i*G, (i+1)*G) must be prompt i's (group_index {want.tolist()}, num_generations {G}), "
            f"got {ro.group_index.cpu().tolist()} and {ro.num_generations}",
        )
    tensors = {"prompt_ids": ro.prompt_ids, "completion_ids": ro.completion_ids, "group_index": ro.group_index}
    slp = ro.extra.get("sampling_logprobs")
    if slp is not None:
        tensors["sampling_logprobs"] = slp
        if tuple(slp.shape) != shapes["completion_ids"]:
            raise _fail(entry, f"{what}: sampling_logprobs {tuple(slp.shape)} must match {shapes['completion_ids']}")
        real = slp[ro.completion_mask.bool()]
        if not bool(torch.isfinite(real).all()) or bool((real > 1e-4).any()):
            raise _fail(entry, f"{what}: sampling_logprobs of real tokens must be finite and <= 0")
    for k, t in tensors.items():
        if t.device != device:
            raise _fail(entry, f"{what}: {k} is on {t.device}, not on the policy's device {device}")


def check_generator(
    name: str, registry: Any = None, *, model_path: str | None = None, env: Any = None, **build_kwargs: Any
) -> None:
    """Rollout-generator conformance (see the module docstring).

    ``model_path``: the ``save_pretrained`` folder of the policy to sample with (a server generator's
    server must serve the same model); default a tiny chat model. ``env``: the env of the episode check
    (default the built-in ``gsm8k`` at difficulty 0). ``build_kwargs`` go to the entry's factory.
    """
    from composer_plugins.training.rollout.rollouts import EpisodeGenerator, RolloutGenerator, WeightSyncing

    entry = _entry("rollout_generators", name, registry)
    gen = _build(entry, **build_kwargs)
    if not isinstance(gen, RolloutGenerator):
        raise _fail(entry, f"built a {type(gen).__name__}, which has no generate(policy, tokenizer, prompts, ...)")
    policy, tok = _policy(model_path)
    device = next(policy.parameters()).device
    try:
        ro = gen.generate(policy, tok, list(PROMPTS), G, seed=3, **SAMPLING)
        again = gen.generate(policy, tok, list(PROMPTS), G, seed=3, **SAMPLING)
    except Exception as e:
        raise _fail(entry, f"generate raised {type(e).__name__}: {e}") from e
    _check_rollout(entry, ro, len(PROMPTS), "generate", device, SAMPLING["max_new_tokens"])
    if _rows(again) != _rows(ro):
        raise _fail(entry, "generate with the same seed sampled other tokens (a step must be reproducible)")
    if isinstance(gen, WeightSyncing):
        every = gen.sync_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise _fail(entry, f"sync_every must be an integer >= 0, got {every!r}")
        answers = [gen.wants_sync(s) for s in range(3)]
        if not all(isinstance(a, bool) for a in answers):
            raise _fail(entry, f"wants_sync(step) must answer a bool, got {answers!r}")
    if isinstance(gen, EpisodeGenerator):
        _check_episodes(entry, gen, policy, tok, env, device)
    close = getattr(gen, "close", None)
    if callable(close):
        close()


def _check_episodes(entry: Any, gen: Any, policy: Any, tok: Any, env: Any, device: Any) -> None:
    if env is None:
        from composer_plugins.core.plugins import get_registry

        env = get_registry().get("envs", "gsm8k").build(difficulty=0)
    tasks = env.sample_tasks(len(PROMPTS), "train", seed=0)
    try:
        out = gen.episodes(policy, tok, env, tasks, G, seed=3, **SAMPLING)
    except Exception as e:
        raise _fail(entry, f"episodes raised {type(e).__name__}: {e}") from e
    if not isinstance(out, tuple) or len(out) != 3:
        raise _fail(entry, "episodes must return (rollout, rewards, feedback)")
    ro, rewards, feedback = out
    _check_rollout(entry, ro, len(tasks), "episodes", device, None)
    rows = len(tasks) * G
    if len(rewards) != rows or len(feedback) != rows:
        raise _fail(entry, f"episodes: {rows} rewards and feedbacks needed, got {len(rewards)} and {len(feedback)}")
    if not all(isinstance(r, float) and (math.isfinite(r) or math.isnan(r)) for r in rewards):
        raise _fail(entry, f"episodes: every reward must be a float (NaN: unscorable), got {rewards!r}")
