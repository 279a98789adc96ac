"""Teacher scores of more than all the probability (issue 51): a log-prob above 0, or duplicate ids whose
probabilities sum above 1, make that teacher's position ``invalid``: counted beside ``nonfinite`` and
``out_of_vocab`` and left out of the loss, on every divergence, both paths, one teacher and many (and on the
sampled-token path)."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses_teacher_distill import DIVERGENCES, PATHS, _channel, _leaves, _two_teachers

from composer_plugins.kernels.divergences import TeacherTopKKernel
from composer_plugins.kernels.teacher_topk import TeacherTopK, sampled_token_divergence, sampled_token_scored
from composer_plugins.losses.teacher_distill import teacher_tokens


def _without(scores: TeacherTopK, where: torch.Tensor) -> TeacherTopK:
    """The same scores with the teacher positions at ``where`` ``(B, N, T)`` not scored."""
    return TeacherTopK(scores.ids.clone(), scores.logprobs.clone(), scores.mask & ~where, scores.names)


def _dirty(scores: TeacherTopK) -> tuple[TeacherTopK, torch.Tensor]:
    dirty = TeacherTopK(scores.ids.clone(), scores.logprobs.clone(), scores.mask.clone(), scores.names)
    where = torch.zeros_like(scores.mask)
    dirty.logprobs[0, 0, 1, 0] = 0.7  # probability 2.01
    where[0, 0, 1] = True
    if scores.ids.shape[1] > 1:  # one id twice, 0.8 + 0.7
        dirty.ids[1, 1, 2, 1] = dirty.ids[1, 1, 2, 0]
        dirty.logprobs[1, 1, 2, :2] = torch.tensor([math.log(0.8), math.log(0.7)], dtype=torch.float64)
        where[1, 1, 2] = True
    return dirty, where


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
@pytest.mark.parametrize("teachers", [1, 2])
def test_more_than_all_the_probability_is_left_out_and_counted(path, divergence, beta, teachers):
    _, _, mask, _ = _leaves()
    s = _two_teachers()
    scores = TeacherTopK(s.ids[:, :teachers], s.logprobs[:, :teachers], s.mask[:, :teachers], s.names[:teachers])
    dirty, where = _dirty(scores)
    kw = {"divergence": divergence, "beta": beta}
    loss, m, grad = _channel(path, dirty, mask, **kw)
    want, wm, wgrad = _channel(path, _without(scores, where), mask, **kw)
    assert m["invalid"] == float(teachers) and wm["invalid"] == 0.0
    assert m["nonfinite"] == m["out_of_vocab"] == 0.0
    assert m["tokens"] == wm["tokens"] == float(mask.sum()) - (1 if teachers == 1 else 0)
    assert float(m["teacher_topk_mass"]) <= 1.0 + 1e-9
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, wgrad, rtol=1e-9, atol=1e-11)
    assert int(teacher_tokens(dirty, mask, 13)) == int(wm["tokens"])


def test_within_rounding_of_one_is_kept():
    """A top-k summing to 1 + 1e-4 (bf16 rounding) is a valid score."""
    _, _, mask, _ = _leaves()
    s = _two_teachers()
    one = TeacherTopK(s.ids[:, :1].clone(), s.logprobs[:, :1].clone(), s.mask[:, :1], s.names[:1])
    one.logprobs[0, 0, 1] = torch.log(torch.tensor([0.6, 0.3, 0.1001], dtype=torch.float64))
    _, m, _ = _channel("hidden_states", one, mask)
    assert m["invalid"] == 0.0 and m["tokens"] == float(mask.sum())


def test_sampled_token_path_leaves_a_log_prob_above_zero_out():
    s = torch.log(torch.tensor([0.5, 0.25, 0.9], dtype=torch.float64)).requires_grad_()
    t = torch.tensor([0.7, math.log(0.5), math.log(0.8)], dtype=torch.float64)
    assert sampled_token_scored(t).tolist() == [False, True, True]
    per = sampled_token_divergence(s, t, TeacherTopKKernel("reverse_kl"))
    assert per[0] == 0.0 and per[1] > 0
