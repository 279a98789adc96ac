"""The EMA self-teacher (``losses.hint_distill.teacher: ema``) and the precondition metrics, on the tiny policy.

Covered here: the update formula (after n optimizer steps the teacher equals the closed form, also with
gradient accumulation and re-used rollouts), the teacher with ``ema`` against the live one (equal before
the first step and at rate 1.0, different after a step at rate 0.05), ``train/hint/teacher_margin`` against
a plain full-logits computation, ``train/hint/fraction``. Exact resume, DDP and FSDP are in
``test_training_loop.py`` and ``test_training_dp.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.runs.run import run_train
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import load_policy_for

HINT = """
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {{weight: 0.5, teacher: {teacher}, ema_rate: {rate}}}
"""


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _closed_form(thetas: list[dict[str, torch.Tensor]], rate: float) -> dict[str, torch.Tensor]:
    """EMA after n = len(thetas) - 1 steps: (1-r)^n θ_0 + Σ_k r (1-r)^(n-k) θ_k."""
    n = len(thetas) - 1
    out = {}
    for name in thetas[0]:
        acc = (1 - rate) ** n * thetas[0][name].double()
        for k in range(1, n + 1):
            acc = acc + rate * (1 - rate) ** (n - k) * thetas[k][name].double()
        out[name] = acc.float()
    return out


@pytest.mark.parametrize("over", [("trainer.accumulate_grad_batches=2",), ("rollout.num_iterations=2",)])
def test_ema_after_n_optimizer_steps_is_the_closed_form(make_cfg, over):
    from lightning.pytorch.callbacks import Callback

    rate = 0.3
    thetas: dict[int, dict[str, torch.Tensor]] = {}
    seen: dict[str, object] = {}

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            thetas[0] = _params(pl_module.policy)
            assert all(torch.equal(thetas[0][n], p) for n, p in _params(pl_module.ema_teacher.policy).items())

        def on_train_batch_end(self, trainer, pl_module, *a):
            thetas[trainer.global_step] = _params(pl_module.policy)  # the last batch of a step: after its update

        def on_train_end(self, trainer, pl_module):
            seen["ema"] = _params(pl_module.ema_teacher.policy)
            seen["frozen"] = all(not p.requires_grad for p in pl_module.ema_teacher.parameters())
            seen["eval"] = not any(m.training for m in pl_module.ema_teacher.modules())

    cfg, src = make_cfg(
        HINT.format(teacher="ema", rate=rate), "trainer.max_steps=3", "hints.teacher_margin=true", *over
    )
    res = run_train(cfg, src, extra_callbacks=[Record()])
    assert sorted(thetas) == [0, 1, 2, 3] and len(res.history) == 3
    assert seen["frozen"] and seen["eval"]
    want = _closed_form([thetas[k] for k in range(4)], rate)
    assert seen["ema"].keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(seen["ema"][name], value, rtol=1e-5, atol=1e-6)
    # the teacher moved (a step changed the policy) but is not the policy
    assert any(not torch.equal(seen["ema"][n], thetas[3][n]) for n in want)
    for row in res.history:
        assert row["train/hint_distill/skipped"] == 0.0 and row["train/hint/rows"] > 0
        assert 0.0 < row["train/hint/fraction"] <= 1.0
        assert "train/hint/teacher_margin" in row


def _module(make_cfg, teacher: str, rate: float, policy=None, tok=None, env=None, *over: str):
    cfg, src = make_cfg(HINT.format(teacher=teacher, rate=rate), "hints.teacher_margin=true", *over)
    env = env if env is not None else build_env(cfg, src)
    if policy is None:
        policy, tok = load_policy_for(cfg, env)
    return ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src), env


def _step(module: ComposerModule, rb) -> None:
    """One optimizer step of the shared policy on ``rb`` (SGD, big enough to move every weight)."""
    loss, _ = module.loss_on(rb, seed=0)
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.5)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_ema_teacher_equals_live_at_start_and_at_rate_one_and_differs_after_a_step(make_cfg):
    live, env = _module(make_cfg, "live", 0.05)
    policy, tok = live.policy, live.tokenizer
    slow, _ = _module(make_cfg, "ema", 0.05, policy, tok, env)
    copy, _ = _module(make_cfg, "ema", 1.0, policy, tok, env)
    assert live.ema_teacher is None and slow.ema_teacher is not None
    tasks = env.sample_tasks(2, "train", seed=5)
    rb = live.make_rollout_batch(tasks, seed=3)
    assert rb.hint_rows

    def hint_stats(m: ComposerModule) -> tuple[float, float]:
        with torch.no_grad():
            _, stats = m.loss_on(rb, seed=0)
        return stats["hint_distill/loss"], stats["hint/teacher_margin"]

    before = hint_stats(live)
    assert hint_stats(slow) == before and hint_stats(copy) == before  # the EMA starts as the policy
    _step(live, rb)
    for m in (slow, copy):
        m.update_ema_teacher()
    after = hint_stats(live)
    assert after != before
    assert hint_stats(copy) == after  # rate 1.0: the teacher is the policy of the last step, exactly
    ema_loss, ema_margin = hint_stats(slow)
    assert ema_loss != after[0] and ema_margin != after[1]  # rate 0.05: mostly the old weights
    p_now = dict(policy.named_parameters())
    for n, t in slow.ema_teacher.policy.named_parameters():
        assert not t.requires_grad and t.grad is None
        assert torch.equal(dict(copy.ema_teacher.policy.named_parameters())[n], p_now[n])


def test_teacher_margin_and_fraction_equal_a_full_logits_computation(make_cfg):
    from composer_plugins.models.generation import tokenize_prompts

    # the margin compares the distributions sampled from (÷ temperature)
    module, env = _module(make_cfg, "live", 0.05, None, None, None, "rollout.temperature=0.7")
    rb = module.make_rollout_batch(env.sample_tasks(2, "train", seed=7), seed=11)
    with torch.no_grad():
        _, stats = module.loss_on(rb, seed=0)
    ro, T = rb, 0.7
    policy = module.policy.eval()
    h_ids, h_mask = tokenize_prompts(module.tokenizer, rb.hinted_contexts, module.cfg.hints.max_context_length, "cpu")
    diffs = []
    with torch.no_grad():
        for j, row in enumerate(rb.hint_rows):
            comp = ro.completion_ids[row][ro.completion_mask[row].bool()]
            sides = []
            for ids, m in ((ro.prompt_ids[row], ro.prompt_mask[row]), (h_ids[j], h_mask[j])):
                ctx = ids[m.bool()]
                logits = policy(input_ids=torch.cat([ctx, comp])[None]).logits[0].float() / T
                logp = F.log_softmax(logits[len(ctx) - 1 : len(ctx) - 1 + len(comp)], -1)
                sides.append(logp.gather(-1, comp[:, None])[:, 0])
            diffs.append(sides[1] - sides[0])
    want = torch.cat(diffs).mean().item()
    assert stats["hint/teacher_margin"] == pytest.approx(want, abs=1e-4)
    assert abs(want) > 1e-3  # the hint changes what the policy expects
    assert stats["hint/fraction"] == len(rb.hint_rows) / ro.completion_ids.shape[0]
    assert stats["hint/rows"] == len(rb.hint_rows)


def test_a_bf16_ema_teacher_follows_updates_below_half_a_bf16_step():
    """A bf16 teacher (``bf16-mixed``) still moves when each update is below half a bf16 step: a plain bf16 lerp
    rounds every one of them away and stays where it started; the dithered rounding is unbiased, deterministic
    for a given salt (resume-exact) and varies with it."""
    from composer_plugins.training.step.ema import ema_update

    torch.manual_seed(0)
    start = torch.randn(20_000, dtype=torch.float64).float() + 4.0  # bf16 steps of 1/32 in [4, 8)
    policy = start.to(torch.bfloat16).float() + 0.005  # 0.005 ahead: each rate-0.01 update moves 5e-5
    plain, dithered = start.to(torch.bfloat16), start.to(torch.bfloat16)
    for step in range(1500):
        plain.lerp_(policy.to(torch.bfloat16), 0.01)
        ema_update([(dithered, policy)], 0.01, salt=step)
    assert (plain.float() - policy).mean().item() == pytest.approx(-0.005, abs=1e-4)  # stuck
    gap = (dithered.float() - policy).mean().item()
    assert abs(gap) < 0.005 * (1 - 0.01) ** 1500 + 5e-4  # followed like the fp32 EMA, within rounding noise
    a, b = start.to(torch.bfloat16), start.to(torch.bfloat16)
    ema_update([(a, policy)], 0.01, salt=7)
    ema_update([(b, policy)], 0.01, salt=7)
    assert torch.equal(a, b)
    ema_update([(b, policy)], 0.01, salt=8)
    ema_update([(a, policy)], 0.01, salt=9)
    assert not torch.equal(a, b)
