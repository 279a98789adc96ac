"""Conformance checks: one function per kind, each run over a registry entry (built-in or third-party).

Every check builds the component through the registry, as the training stack does, and asserts its side of
the contract; a failure raises :class:`ConformanceError` naming the kind, the entry, its provider and what
broke. :func:`check` dispatches on the kind. What each kind is checked for is tabled in docs/plugins.md
(losses, advantage estimators, envs, hints, teachers, scorers, backends, optimizers, callbacks; rollout generators in
:mod:`composer_plugins.testing.generators`, DiLoCo transports in :mod:`composer_plugins.testing.transports`,
codecs in :func:`check_codec`).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from composer_plugins.testing.base import ConformanceError as ConformanceError  # re-exported: its old home
from composer_plugins.testing.base import _build, _entry, _fail


def check(kind: str, name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Run the conformance checks of ``kind`` on the registered ``name`` (``build_kwargs`` go to its factory)."""
    from composer_plugins.core.registry import normalize_kind
    from composer_plugins.testing.executors import check_executor
    from composer_plugins.testing.generators import check_generator
    from composer_plugins.testing.transports import check_transport

    kind = normalize_kind(kind)
    checks: dict[str, Callable[..., None]] = {
        "losses": check_loss,
        "advantage_estimators": check_advantage_estimator,
        "envs": check_env,
        "hints": check_hint_provider,
        "teachers": check_teacher,
        "scorers": check_scorer,
        "backends": check_backend,
        "optimizers": check_optimizer,
        "callbacks": check_callback,
        "codecs": check_codec,
        "rollout_generators": check_generator,
        "transports": check_transport,
        "executors": check_executor,
    }
    fn = checks.get(kind, check_builds)
    if fn is check_builds:
        fn(kind, name, registry, **build_kwargs)
    else:
        fn(name, registry, **build_kwargs)


def check_advantage_estimator(name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Advantage-estimator conformance: ``est(rewards, group_size)`` returns one finite float per row (an
    unscorable NaN reward included) and leaves the rewards as they were."""
    import torch

    entry = _entry("advantage_estimators", name, registry)
    est = entry.build(**build_kwargs)
    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.5, 1.0, 1.0, 1.0, 1.0])
    given = rewards.clone()
    try:
        out = est(given, 4)
    except Exception as e:
        raise _fail(entry, f"raised {type(e).__name__}: {e} on rewards {rewards.tolist()} in groups of 4") from e
    if not isinstance(out, torch.Tensor) or out.shape != rewards.shape or not out.is_floating_point():
        raise _fail(entry, f"returned {out!r}, not a float tensor of shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(out).all()):
        raise _fail(entry, f"returned non-finite advantages {out.tolist()} (an unscorable row's must be finite)")
    if not torch.equal(given.nan_to_num(-9.0), rewards.nan_to_num(-9.0)):
        raise _fail(entry, "changed the rewards it was given (in place)")


def check_builds(kind: str, name: str, registry: Any = None, **build_kwargs: Any) -> Any:
    """The least any entry must do: its factory resolves and builds."""
    return _build(_entry(kind, name, registry), **build_kwargs)


# -- losses ---------------------------------------------------------------------------------------


def loss_batch(
    *, dtype: Any = None, pad_width: int = 0, perm: Any = None, noise_on_padding: bool = False, seed: int = 0
) -> dict[str, Any]:
    """One ``inputs`` mapping holding every input a built-in channel can ask for, on 4 rows × 6 tokens.

    Rows 1 and 2 end in padding (``completion_mask`` 0); ``hint_mask`` selects rows 0 and 1.
    Policy log-probs, hidden states and logits derive from leaf tensors (``_leaves``) so gradients
    can be followed. ``pad_width`` appends all-padding columns, ``perm`` reorders the rows,
    ``noise_on_padding`` writes random values where no mask selects a position.
    """
    import torch

    dtype = dtype or torch.float32
    B, T, V, H = 4, 6, 11, 8
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    teacher_hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    ids = torch.randint(V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[2, 3:] = 0
    hint = torch.zeros(B, T)
    hint[0] = mask[0]
    hint[1] = mask[1]
    adv = torch.tensor([1.0, -0.5, 0.75, -1.25], dtype=torch.float64)
    old_noise = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.05
    ref_noise = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.05
    pad_noise = torch.randn(B, T, H, generator=g, dtype=torch.float64) * 3
    if noise_on_padding:
        off = (mask == 0) & (hint == 0)
        hidden = torch.where(off.unsqueeze(-1), pad_noise, hidden)
        teacher_hidden = torch.where(off.unsqueeze(-1), -pad_noise, teacher_hidden)
        old_noise = torch.where(off, old_noise + 1.0, old_noise)
        ref_noise = torch.where(off, ref_noise - 1.0, ref_noise)
    if pad_width:
        z = torch.zeros(B, pad_width, H, dtype=torch.float64)
        hidden, teacher_hidden = torch.cat([hidden, z + 0.3], 1), torch.cat([teacher_hidden, z - 0.3], 1)
        ids = torch.cat([ids, torch.zeros(B, pad_width, dtype=ids.dtype)], 1)
        mask, hint = torch.cat([mask, torch.zeros(B, pad_width)], 1), torch.cat([hint, torch.zeros(B, pad_width)], 1)
        old_noise = torch.cat([old_noise, torch.zeros(B, pad_width, dtype=torch.float64)], 1)
        ref_noise = torch.cat([ref_noise, torch.zeros(B, pad_width, dtype=torch.float64)], 1)
    if perm is not None:
        hidden, teacher_hidden, ids, mask, hint = hidden[perm], teacher_hidden[perm], ids[perm], mask[perm], hint[perm]
        adv, old_noise, ref_noise = adv[perm], old_noise[perm], ref_noise[perm]
    h = hidden.to(dtype).requires_grad_()
    th = teacher_hidden.to(dtype)
    w = weight.to(dtype).requires_grad_()
    logits = h @ w.T
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(dtype)
    lp = logprobs.detach()
    pairs = torch.tensor([-3.0, -4.5], dtype=torch.float64)
    chosen = w[:2, :3].sum(-1) * 0.1 + pairs.to(dtype)  # one value per pair, from the LM-head leaf
    rejected = w[2:4, :3].sum(-1) * 0.1 + pairs.to(dtype) - 1.0
    mcl = mask.shape[1]
    inputs = {
        "logprobs": logprobs,
        "hidden_states": h,
        "student_hidden": h,
        "teacher_hidden": th,
        "lm_head_weight": w,
        "student_logits": logits,
        "teacher_logits": (th @ w.detach().T),
        "chosen_logps": chosen,
        "rejected_logps": rejected,
        "chosen_avg_logps": chosen / 5.0,
        "rejected_avg_logps": rejected / 7.0,
    }
    # three teachers' top-4 over the student's vocabulary (the teacher_distill channel), from the same
    # teacher hidden states (so padding, order and width follow the rows), teacher 2 half as sharp
    from composer_plugins.losses.teacher_distill import TeacherTopK

    t_logits = (th.double() @ weight.T).unsqueeze(1) * torch.tensor([1.0, 1.2, 0.5], dtype=torch.float64).view(
        1, 3, 1, 1
    )
    top = torch.log_softmax(t_logits, -1).topk(4, -1)
    scored = (mask > 0).unsqueeze(1).expand(-1, 3, -1).clone()
    teacher_scores = TeacherTopK(top.indices, top.values.to(dtype), scored, ("a", "b", "c"))
    inputs |= {
        "teacher_scores": teacher_scores,
        "completion_ids": ids,
        "completion_mask": mask.to(dtype),
        "hint_mask": hint.to(dtype),
        "advantages": adv.to(dtype),
        "old_logprobs": lp + old_noise.to(dtype),
        "ref_logprobs": lp + ref_noise.to(dtype),
        "inference_logprobs": lp + old_noise.to(dtype) * 0.5,
        "max_completion_length": mcl - pad_width,
        "ref_chosen_logps": pairs.to(dtype) + 0.2,
        "ref_rejected_logps": pairs.to(dtype) - 0.7,
        "chosen_lengths": torch.tensor([5.0, 5.0], dtype=dtype),
        "rejected_lengths": torch.tensor([7.0, 7.0], dtype=dtype),
        "_leaves": (h, w),
    }
    return inputs


def _run_loss(channel: Any, inputs: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    return copy.deepcopy(channel)(inputs)  # a fresh copy: stateful channels (schedules) do not drift


def check_loss(name: str, registry: Any = None, inputs: Callable[..., Any] | None = None, **build_kwargs: Any) -> None:
    """Loss-channel conformance (see the module docstring). ``inputs(**kw)`` may replace :func:`loss_batch`
    (it returns the one inputs mapping the channel's ``forward(inputs)`` reads, with ``_leaves``)."""
    import torch

    from composer_plugins.losses.base import LossChannel, check_contract

    make = inputs or loss_batch
    entry = _entry("losses", name, registry)
    ch = entry.build(weight=0.5, name="conformance", **build_kwargs)
    if not isinstance(ch, LossChannel):
        raise _fail(entry, f"built a {type(ch).__name__}, not a LossChannel")
    if ch.weight != 0.5 or ch.name != "conformance":
        raise _fail(entry, "does not take weight= and name= (the composer sets both)")
    try:
        check_contract(type(ch))
    except TypeError as e:
        raise _fail(entry, str(e)) from e
    batch = make()
    missing = ch.missing_inputs(batch)
    if missing:
        raise _fail(entry, f"needs inputs the conformance batch lacks: {missing}; pass inputs= with them")
    loss, metrics = _run_loss(ch, batch)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise _fail(entry, f"forward must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
    if not torch.isfinite(loss):
        raise _fail(entry, f"loss is not finite: {float(loss)}")
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise _fail(entry, "metrics must be a mapping with string keys")
    for k, v in metrics.items():
        try:
            float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
        except (TypeError, ValueError, RuntimeError) as e:
            raise _fail(entry, f"metric {k!r} is not a scalar: {v!r}") from e
    # gradient flow: back into the leaves every policy-side input derives from
    loss.backward()
    grads = [t.grad for t in batch["_leaves"] if t.grad is not None]
    if not grads or not any(bool(gr.abs().sum() > 0) for gr in grads):
        raise _fail(entry, "no gradient reaches the policy's inputs (log-probs / hidden states / LM head)")
    if not all(bool(torch.isfinite(gr).all()) for gr in grads):
        raise _fail(entry, "gradient has NaN/inf")
    ref = float(loss.detach())

    def value(**kw: Any) -> float:
        return float(_run_loss(ch, make(**kw))[0].detach())

    def close(a: float, b: float, tol: float) -> bool:
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)

    got = value(noise_on_padding=True)
    if not close(got, ref, 1e-5):
        raise _fail(entry, f"padding changes the loss ({ref:.6g} -> {got:.6g}): mask every per-token term")
    got = value(perm=torch.tensor([2, 3, 0, 1]))
    if not close(got, ref, 1e-5):
        raise _fail(entry, f"the order of rows changes the loss ({ref:.6g} -> {got:.6g})")
    got = value(pad_width=3)
    if not close(got, ref, 1e-5):
        raise _fail(entry, f"padding the micro-batch wider changes the loss ({ref:.6g} -> {got:.6g})")
    got = value(dtype=torch.float64)
    if not close(got, ref, 1e-4):
        raise _fail(entry, f"float64 inputs give {got:.6g}, float32 {ref:.6g}")
    low = _run_loss(ch, make(dtype=torch.bfloat16))[0].detach()
    if not bool(torch.isfinite(low)) or not close(float(low), ref, 0.1):
        raise _fail(entry, f"bfloat16 inputs give {float(low):.6g}, float32 {ref:.6g}")


# -- envs and hint providers --------------------------------------------------------------------


def check_env(name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Env conformance (see the module docstring)."""
    from composer_plugins.chat.env_step import step_result

    entry = _entry("envs", name, registry)
    env = entry.build(**build_kwargs)
    try:
        tasks = env.sample_tasks(3, split="train", seed=7)
        again = env.sample_tasks(3, split="train", seed=7)
        if len(tasks) != 3 or not all(isinstance(t, Mapping) and isinstance(t.get("prompt"), str) for t in tasks):
            raise _fail(entry, "sample_tasks(3) must give 3 dicts, each with a 'prompt' string")
        if json.dumps(tasks, sort_keys=True, default=str) != json.dumps(again, sort_keys=True, default=str):
            raise _fail(entry, "sample_tasks with the same seed gave different tasks")
        prompts = [t["prompt"] for t in tasks]
        columns = {k: [t.get(k) for t in tasks] for k in tasks[0] if k != "prompt"}
        for completions in (["", "no idea", "#### 0"], [None, {"role": "assistant", "content": "x"}, "42"]):
            rewards = env.reward(prompts, completions, **columns)
            if len(rewards) != 3:
                raise _fail(entry, f"reward gave {len(rewards)} values for 3 completions")
            for r in rewards:
                if r is not None and not (isinstance(r, int | float) and math.isfinite(r)):
                    raise _fail(entry, f"reward must be a finite number or None, got {r!r}")
        if hasattr(env, "reset") and hasattr(env, "step"):
            env.reset(task=tasks[0], seed=0)
            for _turn in range(int(getattr(env, "max_turns", 1) or 1) + 1):
                _obs, reward, done, _info = step_result(env.step("#### 0"))
                if reward is not None and not math.isfinite(float(reward)):
                    raise _fail(entry, f"step reward is not finite: {reward!r}")
                if done:
                    break
            else:
                raise _fail(entry, f"the episode did not end within max_turns={getattr(env, 'max_turns', 1)} steps")
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()


def check_hint_provider(name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Hint-provider conformance (see the module docstring)."""
    from composer_plugins.envs.base import Feedback
    from composer_plugins.envs.hints import as_hint_provider, hint_requests, sibling_groups

    entry = _entry("hints", name, registry)
    provider = as_hint_provider(entry.build(**build_kwargs))  # older shapes adapted once, as training does
    task = {"prompt": "What is 2 + 3?", "answer": "5"}
    wrong = Feedback(
        kind="wrong_answer", message="expected 5, got 6", details={"expected": "5", "got": "6"}, reward=0.0
    )
    right = Feedback(kind="correct", reward=1.0)
    # each completion has a phrase no feedback mentions, so a hint built from it is recognisable
    own_wrong = "Two plus three makes six, I think.\n#### 6"
    own_right = "Adding three to two gives five.\n#### 5"
    sibling_ok = "Counting on from two: three, four, five.\n#### 5"
    args = ([wrong, right], [task["prompt"]] * 2, [own_wrong, own_right], [task, task])
    out = provider.hints(hint_requests(*args))
    if len(out) != 2 or not all(h is None or isinstance(h, str) for h in out):
        raise _fail(entry, f"hints(requests) must give one string or None per request, got {out!r}")
    # the rollout group: the failed row 0, the passing row 1, a passing sibling and a failed one
    group = sibling_groups([own_wrong, own_right, sibling_ok, "#### 7"], [0.0, 1.0, 1.0, 0.0], 4, 1.0)
    with_groups = [provider.hints(hint_requests(*args, groups=group[:2])) for _ in range(2)]
    out = with_groups[0]
    if len(out) != 2 or not all(h is None or isinstance(h, str) for h in out):
        raise _fail(entry, f"with groups, hints(requests) must give one string or None per request, got {out!r}")
    for h, own in zip(out, (own_wrong, own_right), strict=True):
        if h and own.split("\n")[0] in h:
            raise _fail(entry, f"a hint repeats the row's own completion {own!r}: {h!r}; use a sibling's instead")
    if with_groups[0] != with_groups[1]:
        raise _fail(entry, f"the same rows and groups gave different hints: {with_groups[0]!r} vs {with_groups[1]!r}")


# -- scoring teachers ------------------------------------------------------------------------------


def check_scorer(name: str, registry: Any = None, *, tokenizer: Any = None, **build_kwargs: Any) -> None:
    """Scorer conformance (see the module docstring). ``tokenizer``: the student's (a path or an object)."""
    import torch

    from composer_plugins.teachers.scoring import ScoreRequest, TeacherScorer

    entry = _entry("scorers", name, registry)
    scorer = entry.build(**build_kwargs)
    if not isinstance(scorer, TeacherScorer):
        raise _fail(entry, f"built a {type(scorer).__name__}, not a TeacherScorer")
    if tokenizer is None:
        raise _fail(entry, "the scorer check needs tokenizer= (the student's tokenizer, or a path to one)")
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    try:
        scorer.bind(tokenizer)
        reqs = []
        for prompt, completion in (("What is 2 + 3?", " 2 + 3 = 5\n#### 5"), ("Add 4 and 4.", " #### 8")):
            ids = tuple(tokenizer(completion, add_special_tokens=False)["input_ids"])
            p_ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            reqs.append(ScoreRequest(prompt, completion, ids, p_ids))
        out = scorer.score(reqs)
        again = scorer.score(reqs)
    finally:
        scorer.close()
    if len(out) != len(reqs):
        raise _fail(entry, f"score() gave {len(out)} results for {len(reqs)} rows")
    V = len(tokenizer)
    for r, s, s2 in zip(reqs, out, again, strict=True):
        if s is None:
            continue
        T = len(r.completion_ids)
        ids, lps, mask = s.token_ids, s.logprobs, s.mask
        if ids.dim() != 2 or ids.shape[0] != T or tuple(lps.shape) != tuple(ids.shape) or tuple(mask.shape) != (T,):
            raise _fail(
                entry,
                f"scores must be token_ids/logprobs [T={T}, K] and mask [T], got "
                f"{tuple(ids.shape)}, {tuple(lps.shape)}, {tuple(mask.shape)}",
            )
        real = ids >= 0
        if bool((ids[real] >= V).any()) or bool((ids < -1).any()):
            raise _fail(entry, f"token ids must lie in the student's vocabulary [0, {V}) (or be -1 for none)")
        if bool((lps[real] > 1e-6).any()):
            raise _fail(entry, "log-probs must be <= 0")
        mass = torch.where(real, lps.double().exp(), torch.zeros((), dtype=torch.float64, device=lps.device)).sum(-1)
        if bool((mass[mask.bool()] > 1 + 1e-4).any()):
            raise _fail(entry, f"a token's top-k probabilities sum past 1 ({float(mass.max()):.4f})")
        if s2 is None or not torch.equal(ids, s2.token_ids) or not torch.allclose(lps, s2.logprobs, atol=1e-5):
            raise _fail(entry, "the same rows scored twice gave different scores")


# -- teachers -------------------------------------------------------------------------------------


def check_teacher(
    name: str, registry: Any = None, *, failing: Mapping[str, Any] | None = None, **build_kwargs: Any
) -> None:
    """Teacher conformance: cache, budget and error contract (see the module docstring).

    ``failing`` are build kwargs under which a call fails (e.g. an unreachable ``base_url``);
    without it the error contract is checked on an empty conversation only.
    """
    import asyncio
    import tempfile
    from pathlib import Path

    from composer_plugins.teachers.base import Teacher, TeacherCallError, TeacherError
    from composer_plugins.teachers.cache import ReplayCache
    from composer_plugins.teachers.engine import ReplayEngine
    from composer_plugins.teachers.traces import TraceState

    entry = _entry("teachers", name, registry)
    teacher = entry.build(**build_kwargs)
    if not isinstance(teacher, Teacher):
        raise _fail(entry, f"built a {type(teacher).__name__}, not a Teacher")
    try:
        p1, p2 = teacher.cache_params(), entry.build(**build_kwargs).cache_params()
        json.dumps(p1, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise _fail(entry, f"cache_params() must be JSON: {e}") from e
    if json.dumps(p1, sort_keys=True) != json.dumps(p2, sort_keys=True):
        raise _fail(entry, "cache_params() differ between two teachers built with the same settings")
    states = [
        TraceState(
            state_id=f"conf-{i}#0",
            messages=[{"role": "user", "content": f"What is {i} + 2?"}],
            student_action={"role": "assistant", "content": f"#### {i + 3}"},
            metadata={"answer": str(i + 2)},
        )
        for i in range(3)
    ]
    with tempfile.TemporaryDirectory(prefix="cp-conformance-") as tmp:
        cache = ReplayCache(Path(tmp) / "cache.sqlite")
        try:
            res = ReplayEngine([teacher], cache=cache, max_usd=1e6, progress=False, run_id="conf").run(states)
            answers = [(s, r) for s in states for r in res.responses.get(s.state_id, {}).values()]
            if not answers:
                raise _fail(entry, f"no answer to 3 simple states: {[f.message for f in res.failures][:3]}")
            for s, a in answers:
                bound = teacher.max_cost(s.messages)
                priced = teacher.cost(a.prompt_tokens, a.completion_tokens)
                if a.cost_usd < 0 or not math.isclose(a.cost_usd, priced, rel_tol=1e-9, abs_tol=1e-12):
                    raise _fail(entry, f"cost_usd {a.cost_usd} is not the usage priced ({priced})")
                if a.cost_usd > bound + 1e-12:
                    raise _fail(entry, f"a call cost {a.cost_usd} > max_cost() {bound}: the budget's reservation")
            if teacher.cacheable:
                again = ReplayEngine(
                    [entry.build(**build_kwargs)], cache=cache, max_usd=1e6, progress=False, run_id="conf"
                ).run(states)
                if again.stats.calls or again.stats.cache_hits < len(answers):
                    raise _fail(entry, f"the same states again must be cache hits, no calls: {again.stats}")
        finally:
            cache.close()

    async def fail(t: Any, messages: list[dict[str, Any]]) -> Any:
        try:
            return await t.complete(messages)
        finally:
            await t.aclose()

    bad = entry.build(**{**build_kwargs, **failing}) if failing else teacher
    try:
        out = asyncio.run(fail(bad, [] if failing is None else [{"role": "user", "content": "hi"}]))
    except (TeacherCallError, TeacherError):
        return
    except Exception as e:
        raise _fail(entry, f"a failing call must raise TeacherCallError, got {type(e).__name__}: {e}") from e
    if failing:
        raise _fail(entry, f"a call with {dict(failing)} answered ({out!r}) instead of raising TeacherCallError")


# -- backends, optimizers, callbacks --------------------------------------------------------------


def check_backend(name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Backend conformance: requirements declared with an install command; builds when they are present."""
    entry = _entry("backends", name, registry)
    if entry.requires and not entry.install:
        raise _fail(entry, f"requires {list(entry.requires)} but declares no install command (install=...)")
    if not entry.available:
        return  # MissingDependencyError with the install command is the documented behaviour
    _build(entry, **build_kwargs)


def check_optimizer(name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Optimizer conformance: built through ``training.optim.build_optimizer``, one step moves the parameter."""
    from types import SimpleNamespace

    import torch

    from composer_plugins.training.step.optim import build_optimizer

    entry = _entry("optimizers", name, registry)
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optim = SimpleNamespace(
        name=name, lr=0.1, weight_decay=0.0, betas=[0.9, 0.999], eps=1e-8, momentum=0.0, args=build_kwargs
    )
    opt = build_optimizer(optim, [w])
    if not isinstance(opt, torch.optim.Optimizer):
        raise _fail(entry, f"built a {type(opt).__name__}, not a torch.optim.Optimizer")
    (w**2).sum().backward()
    before = w.detach().clone()
    opt.step()
    if torch.equal(before, w.detach()) or not bool(torch.isfinite(w).all()):
        raise _fail(entry, "one step on a non-zero gradient left the parameter unchanged (or not finite)")


def check_callback(name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Callback conformance: builds a ``lightning.pytorch.Callback``."""
    from lightning.pytorch.callbacks import Callback

    entry = _entry("callbacks", name, registry)
    cb = entry.build(**build_kwargs)
    if not isinstance(cb, Callback):
        raise _fail(entry, f"built a {type(cb).__name__}, not a lightning.pytorch.Callback")


def check_codec(name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """Codec conformance (see the module docstring): the entry of ``registry`` (default: the process-wide one)
    built once and run through the transport's own ``encode_vector``/``decode_vector``."""
    import torch

    from composer_plugins.diloco.store import CorruptObjectError, decode_vector, encode_vector, pack, unpack

    entry = _entry("codecs", name, registry)
    codec = entry.build(**build_kwargs)
    tol = float(getattr(codec, "tolerance", 0.0))
    g = torch.Generator().manual_seed(0)
    cases = {
        "empty": torch.zeros(0),
        "one value": torch.tensor([0.25]),
        "255 values": torch.randn(255, generator=g),
        "10,007 values": torch.randn(10_007, generator=g) * 1e-3,
        "zeros": torch.zeros(4099),
        "a huge range": torch.randn(3000, generator=g) * torch.logspace(-6, 3, 3000),
    }
    for what, v in cases.items():
        try:
            h, body = encode_vector(v, name, codec)
            again = encode_vector(v.clone(), name, codec)
            out = decode_vector(*unpack(pack(h, body)), codec)
        except Exception as e:
            raise _fail(entry, f"{what}: the round trip raised {type(e).__name__}: {e}") from e
        if again != (h, body):
            raise _fail(entry, f"{what}: two encodes of one vector gave different bytes (not deterministic)")
        if type(out) is not torch.Tensor or out.dtype != torch.float32 or out.device.type != "cpu":
            raise _fail(entry, f"{what}: decoded {type(out).__name__} {getattr(out, 'dtype', '')}, not fp32 on the CPU")
        if out.shape != v.shape:
            raise _fail(entry, f"{what}: decoded {tuple(out.shape)} values for {tuple(v.shape)}")
        if tol == 0.0:
            if not torch.equal(out, v):
                raise _fail(entry, f"{what}: tolerance 0 (lossless) but the round trip changed values")
        elif v.numel():
            err = float((out - v).norm() / v.norm().clamp_min(1e-30)) if bool(v.any()) else float(out.abs().max())
            if not err <= tol:
                raise _fail(entry, f"{what}: relative error {err:.4g} above its tolerance {tol}")
    h, body = encode_vector(cases["255 values"], name, codec)
    bad = {
        "a truncated body": (h, body[:-1]),
        "a body with a byte more": (h, body + b"\0"),
        "an empty body": (h, b""),
        "a header of another size": ({**h, "numel": 254}, body),
    }
    for what, (hh, bb) in bad.items():
        try:
            decode_vector(hh, bb, codec)
        except CorruptObjectError as e:
            if name not in str(e) and "codec" not in str(e) and "body" not in str(e):
                raise _fail(entry, f"{what}: the error does not say what is wrong: {e}") from e
            continue
        except Exception as e:
            raise _fail(entry, f"{what}: raised {type(e).__name__} ({e}), not CorruptObjectError") from e
        raise _fail(entry, f"{what} decoded without an error (a corrupt body must be refused)")
    try:
        encode_vector(torch.zeros(4, device="meta"), name, codec)
    except TypeError:
        pass
    else:
        raise _fail(entry, "a tensor on another device was encoded (codecs take host tensors only)")
