"""The gap predictor: how far each configured teacher sits from the student, measured before paying for RL.

A distillation channel can only teach what its teacher knows that the student does not. For each study
variant, on training prompts and from the starting policy (the SFT model), :func:`measure_gap` measures
every teacher the variant configures:

* the **hinted self-teacher** (``hint_distill`` with the variant's ``hints.provider``): the policy itself
  with the hint in its context;
* each **external teacher** of ``teacher_distill`` (a ``causal_lm`` scorer: a model directory).

For each, three numbers:

* ``margin`` (nats/token): the mean over the distilled tokens of the student's own sampled completions
  (``rollout.num_generations`` per prompt at the rollout temperature) of ``log p_teacher(token) -
  log p_student(token)``: how much likelier the teacher finds what the student wrote (negative: the teacher
  disagrees with it, which is what it can correct);
* ``fix_rate``: of the training problems the student fails greedily that the teacher covers, the share the
  teacher solves greedily (hinted: the policy with the hint in context, ``eval.hint_uplift``; external: the
  teacher model on the bare prompt);
* ``coverage``: the share of those failures the teacher covers (a hint was given; an external teacher covers
  every one).

``composer-plugins study gap`` writes them to ``results/gap.json``; the paired report lists them beside each
variant's effect with their correlation (a 2026 study finds self-distillation's final gain linear in the
initial student-teacher gap).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.io import atomic_write_json, read_jsonl
from composer_plugins.pipeline.paired import gap_correlation
from composer_plugins.pipeline.stage_train import channel_flags, train_config

__all__ = ["gap_correlation", "measure_gap", "teachers_of"]


def teachers_of(train_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The teachers a variant's effective ``train`` config distils from: ``{"hint": provider spec}`` when
    ``hint_distill`` is active, and ``{"teacher:<id>": model_path}`` per ``causal_lm`` teacher of an active
    ``teacher_distill``."""
    flags = channel_flags(train_cfg)
    out: dict[str, Any] = {}
    if flags.get("hint_distill"):
        out["hint"] = (train_cfg.get("hints") or {}).get("provider")
    if flags.get("teacher_distill"):
        for t in (train_cfg.get("losses") or {}).get("teacher_distill", {}).get("teachers") or []:
            if t.get("kind", "causal_lm") == "causal_lm" and t.get("model_path"):
                out[f"teacher:{t.get('id', 'teacher')}"] = t["model_path"]
    return out


def _eval(cfg: dict[str, Any], checkpoint: str, tasks_path: str, n: int, hint_uplift: bool) -> tuple[dict, list]:
    from composer_plugins.training.config.train import train_config_from_dict
    from composer_plugins.training.runs.run import run_eval

    c = json.loads(json.dumps(cfg))
    c["data"] = {**c.get("data", {}), "test_path": tasks_path}
    c["eval"] = {
        **c.get("eval", {}),
        "num_problems": n,
        "k": 0,
        "num_samples": 0,
        "at_start": False,
        "at_end": False,
        "predictions": True,
        "hint_uplift": hint_uplift,
    }
    with tempfile.TemporaryDirectory(prefix="gap-") as td:
        res = run_eval(train_config_from_dict(c), checkpoint=checkpoint, output=f"{td}/eval.json")
        preds = read_jsonl(f"{td}/eval.predictions.jsonl")
    return res, preds


def _margins(
    cfg: dict[str, Any], tasks: Sequence[Mapping[str, Any]], models: Mapping[str, str], seed: int
) -> dict[str, float]:
    """``{name: nats/token}``: the hinted self-teacher's (``hint``) and each external model's margin on one rollout."""
    import torch

    from composer_plugins.models.logprobs import completion_logprobs_no_grad
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.config.train import train_config_from_dict
    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.step.policy import load_policy_for

    tc = train_config_from_dict(cfg)
    tc.hints.teacher_margin = True  # what this measures
    policy, tok = load_policy_for(tc)
    module = ComposerModule(tc, policy=policy, tokenizer=tok)
    module.eval()
    out: dict[str, float] = {}
    with torch.no_grad():
        rec = module.make_rollout_batch(list(tasks), seed)
        if "hint" in models:
            _, stats = module.loss_on(rec, seed)
            out["hint"] = float(stats.get("hint/teacher_margin", math.nan))
            out["hint_rows"] = float(stats.get("hint/fraction", 0.0))
        kw = {"temperature": tc.rollout.temperature, "completion_attention_mask": rec.attention_mask}
        args = (rec.prompt_ids, rec.prompt_mask, rec.completion_ids, rec.completion_mask)
        student = completion_logprobs_no_grad(policy, *args, **kw)
        mask = rec.completion_mask.float()
        for name, path in models.items():
            if name == "hint":
                continue
            teacher, _ = load_policy(path, dtype=tc.model.dtype)
            lp = completion_logprobs_no_grad(teacher, *args, **kw)
            out[name] = float(((lp - student) * mask).sum() / mask.sum().clamp(min=1))
    return out


def measure_gap(
    params: Mapping[str, Any],
    variants: Sequence[str],
    *,
    model: str,
    tasks_path: str,
    num_prompts: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """``{variant: {teacher: {margin, fix_rate, coverage}}}`` on the first ``num_prompts`` tasks of ``tasks_path``
    (training prompts), from the policy at ``model``. Variants without a teacher get ``{}``."""
    tasks = read_jsonl(tasks_path)[:num_prompts]
    out: dict[str, Any] = {"model": model, "tasks": tasks_path, "num_prompts": len(tasks), "variants": {}}
    student_preds: list[dict[str, Any]] | None = None
    teacher_preds: dict[str, list[dict[str, Any]]] = {}
    for v in variants:
        cfg = train_config(params, v, seed, pairs=None, model=model)
        cfg["mlflow"] = {"enabled": False}
        found = teachers_of(cfg)
        row: dict[str, Any] = {}
        if found:
            margins = _margins(cfg, tasks, found, seed)
            if student_preds is None:
                student_preds = _eval(cfg, model, tasks_path, len(tasks), False)[1]
            failed = [i for i, p in enumerate(student_preds) if not p.get("correct")]
        for name, spec in found.items():
            if name == "hint":
                res, _ = _eval(cfg, model, tasks_path, len(tasks), True)
                fix = next((float(x) for k, x in res.items() if k.endswith("hint_fix_rate")), math.nan)
                cov = next((float(x) for k, x in res.items() if k.endswith("hint_coverage")), math.nan)
                row[name] = {
                    "margin": margins["hint"],
                    "fix_rate": fix,
                    "coverage": cov,
                    "hinted_rows": margins.get("hint_rows", 0.0),
                    "provider": spec,
                }
            else:
                if spec not in teacher_preds:
                    teacher_preds[spec] = _eval(cfg, spec, tasks_path, len(tasks), False)[1]
                tp = teacher_preds[spec]
                fixed = sum(bool(tp[i].get("correct")) for i in failed)
                row[name] = {
                    "margin": margins[name],
                    "fix_rate": fixed / len(failed) if failed else math.nan,
                    "coverage": 1.0,
                    "model_path": spec,
                    "teacher_accuracy": sum(bool(p.get("correct")) for p in tp) / max(1, len(tp)),
                }
        out["variants"][v] = row
    if student_preds is not None:
        out["student_accuracy"] = sum(bool(p.get("correct")) for p in student_preds) / max(1, len(student_preds))
    return out


def write_gap(result: Mapping[str, Any], out: str | os.PathLike[str]) -> Path:
    """Write ``result`` as JSON (atomically)."""
    atomic_write_json(out, dict(result), sort_keys=True, default=str)
    return Path(out)
