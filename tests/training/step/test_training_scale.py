"""The training step at scale: micro-batched = one-shot, and no ``rows × tokens × vocab`` tensor.

* Parity: the composed loss and every parameter gradient of ``ComposerModule.loss_on`` are the same
  (fp32, 1e-6 relative) with one micro-batch, with one row per micro-batch (each micro-batch's
  body checkpointed and recomputed in backward), and on the materialised-logits path the module
  used before (``completion_forward`` logits → log-probs / student and teacher logits), for every
  built-in policy loss, every hint-distillation criterion and the replay channels.
* Memory: a whole training step (rollout, hint teacher, replay pairs, loss, backward) at a 65,536
  vocabulary never creates a tensor as large as ``rows × tokens × vocab``; the same detector does
  see that tensor on the materialised path, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from composer_plugins.models.generation import tokenize_completions, tokenize_prompts
from composer_plugins.models.logprobs import completion_forward, sequence_logprob
from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.rollout.rewards import derive_seed
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import load_policy_for

POLICY_LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo", "dppo"]
CRITERIA = ["jsd", "taid", "entropy_opd"]

# the fixture's YAML has rollout and hints sections already (a repeated key is refused): override them
PARITY = """
replay: {{pairs_path: {pairs}, pairs_per_step: 3}}
"""
PARITY_ROLLOUT = (
    "rollout.prompts_per_step=3",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=10",
    "rollout.temperature=0.7",
)


def _losses(policy: str, criterion: str | None, replay: str | None) -> list[str]:
    over = [*PARITY_ROLLOUT, f"losses.grpo.name={policy}", "losses.grpo.weight=1.0"]
    if policy in ("grpo", "bnpo", "dr_grpo", "dapo", "gspo"):
        over.append("losses.grpo.beta=0.04")  # the KL term and the reference model are live too
    if criterion is not None:
        over += ["losses.hint_distill.weight=0.5", f"losses.hint_distill.criterion={criterion}"]
    else:
        over.append("losses.hint_distill.enabled=false")
    if replay is not None:
        over += [f"losses.replay.name={replay}", "losses.replay.weight=0.3"]
    return over


def _grads(module: ComposerModule) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.policy.named_parameters() if p.grad is not None}


def _materialised_loss(module: ComposerModule, rb, seed: int) -> torch.Tensor:
    """The composed loss as the module computed it before: whole-batch logits, logits-path channels."""
    ro, T = rb, module.cfg.rollout.temperature
    fwd = completion_forward(
        module.policy,
        ro.prompt_ids,
        ro.prompt_mask,
        ro.completion_ids,
        ro.completion_mask,
        temperature=T,
        return_logits=True,
    )
    mask = ro.completion_mask.float()
    lp = fwd.logps * mask  # the hidden-state path leaves off-mask positions at 0
    batch = {
        "completion_mask": mask,
        "advantages": rb.advantages,
        "rewards": rb.rewards,
        "num_generations": ro.num_generations,
        "group_index": ro.group_index,
        "old_logprobs": lp.detach(),
        "inference_logprobs": lp.detach(),
        "global_step": module.global_step,
        "total_steps": module.cfg.trainer.max_steps,
    }
    if rb.ref_logprobs is not None:
        batch["ref_logprobs"] = rb.ref_logprobs
    outputs = {"logprobs": lp}
    if module.needs_teacher and rb.hint_rows:
        idx = torch.tensor(rb.hint_rows)
        h_ids, h_mask = tokenize_prompts(
            module.tokenizer, rb.hinted_contexts, module.cfg.hints.max_context_length, "cpu"
        )
        with torch.no_grad():
            t = completion_forward(
                module.policy,
                h_ids,
                h_mask,
                ro.completion_ids[idx],
                ro.completion_mask[idx],
                temperature=T,
                return_logits=True,
            )
        outputs.update(student_logits=fwd.logits[idx], teacher_logits=t.logits)
        batch["hint_mask"] = mask[idx]
    if module.needs_pairs and module.parts.pairs:
        import random

        k = min(module.cfg.replay.pairs_per_step, len(module.parts.pairs))
        pairs = [module.parts.pairs[i] for i in random.Random(seed).sample(range(len(module.parts.pairs)), k)]
        p_ids, p_mask = tokenize_prompts(
            module.tokenizer, [p["prompt"] for p in pairs] * 2, module.cfg.rollout.max_prompt_length, "cpu"
        )
        comps = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
        c_ids, c_mask = tokenize_completions(module.tokenizer, comps, module.cfg.replay.max_completion_length, "cpu")
        seq = sequence_logprob(completion_forward(module.policy, p_ids, p_mask, c_ids, c_mask).logps, c_mask.float())
        n = c_mask.sum(-1).float()
        outputs.update(
            chosen_logps=seq[:k],
            rejected_logps=seq[k:],
            chosen_avg_logps=seq[:k] / n[:k],
            rejected_avg_logps=seq[k:] / n[k:],
        )
        batch.update(chosen_lengths=n[:k], rejected_lengths=n[k:])
        if module.required_inputs & {"ref_chosen_logps", "ref_rejected_logps"}:
            ref = module.reference if module.reference is not None else module.policy
            with torch.no_grad():
                r = sequence_logprob(completion_forward(ref, p_ids, p_mask, c_ids, c_mask).logps, c_mask.float())
            batch.update(ref_chosen_logps=r[:k], ref_rejected_logps=r[k:])
    loss, _ = module.composer({**batch, **outputs})
    return loss


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys() and a
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5
    den = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    assert den > 0 and num <= rtol * den, f"gradient relative error {num / den:.3g} > {rtol}"


@pytest.mark.parametrize(
    ("policy", "criterion", "replay"),
    [(p, None, None) for p in POLICY_LOSSES]
    + [("grpo", c, None) for c in CRITERIA]
    + [("dapo", "jsd", "replay_dpo"), ("grpo", "taid", "replay_simpo")],
)
def test_micro_batched_step_equals_one_shot(make_cfg, pairs_file, policy, criterion, replay):
    cfg, _ = make_cfg(PARITY.format(pairs=pairs_file), *_losses(policy, criterion, replay))
    env = build_env(cfg)
    base, tok = load_policy_for(cfg, env)
    tasks = env.sample_tasks(3, "train", seed=5)
    seed = derive_seed(0, 1, 7)

    def module(*overrides: str) -> ComposerModule:
        c, s = make_cfg(PARITY.format(pairs=pairs_file), *_losses(policy, criterion, replay), *overrides)
        m = ComposerModule(c, policy=base, tokenizer=tok, env=env, src=s)
        m.train()
        return m

    rb = module().make_rollout_batch(tasks, seed)
    # random advantages: every row carries policy-gradient signal, whatever the rewards were
    rb = rb.replace(advantages=torch.randn(rb.advantages.shape, generator=torch.Generator().manual_seed(0)))
    if criterion is not None:
        assert rb.hint_rows, "the parity case needs hinted rows"
    results = {}
    for label, overrides in {"one_shot": (), "micro": ("compute.micro_batch_size=1", "compute.chunk_size=7")}.items():
        m = module(*overrides)
        base.zero_grad(set_to_none=True)
        loss, stats = m.loss_on(rb, seed)
        loss.backward()
        results[label] = (loss.detach(), _grads(m), stats)
    m = module()
    base.zero_grad(set_to_none=True)
    ref = _materialised_loss(m, rb, seed)
    ref.backward()
    results["materialised"] = (ref.detach(), _grads(m), {})
    base.zero_grad(set_to_none=True)

    one, micro, mat = results["one_shot"], results["micro"], results["materialised"]
    for ch in {"grpo", "hint_distill", "replay"} & {k.split("/")[0] for k in one[2]}:
        assert one[2][f"{ch}/skipped"] == 0.0, (ch, one[2])
    torch.testing.assert_close(micro[0], one[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(one[0], mat[0], rtol=1e-5, atol=1e-6)
    _close(micro[1], one[1], 1e-6)
    _close(one[1], mat[1], 1e-5)
    # the same statistics (clip fractions, KL, per-channel losses) either way
    for k, v in one[2].items():
        assert micro[2][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (by storage) any aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                n = t.untyped_storage().nbytes() // max(t.element_size(), 1)
                if n > self.numel:
                    self.numel, self.op = n, str(func)
        return out


VOCAB = 65_536


@pytest.fixture
def wide_vocab_policy(make_cfg, tmp_path):
    """The tiny test tokenizer under a random Qwen2 body with a 65,536-row vocabulary."""
    from composer_plugins.models.tiny import build_shaped_model
    from composer_plugins.training.step.policy import resolve_policy

    cfg, _ = make_cfg()
    tok_dir = resolve_policy(cfg, build_env(cfg))
    out = tmp_path / "wide-model"
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    }
    return build_shaped_model(tok_dir, out, shape)


def test_training_step_never_builds_rows_tokens_vocab(make_cfg, pairs_file, wide_vocab_policy):
    cfg, src = make_cfg(
        PARITY.format(pairs=pairs_file),
        f"model.name_or_path={wide_vocab_policy}",
        "sft.enabled=false",
        *PARITY_ROLLOUT,
        "rollout.prompts_per_step=4",
        "rollout.num_generations=8",
        "rollout.max_new_tokens=24",
        "losses.hint_distill.weight=0.5",
        "losses.replay.name=replay_dpo",
        "losses.replay.weight=0.1",
        "rollout.success_threshold=2.0",  # every row fails, so every row is hinted
        "compute.micro_batch_tokens=256",
    )
    m = ComposerModule(cfg, src=src)
    m.train()
    assert m.policy.config.vocab_size == VOCAB
    tasks = build_env(cfg).sample_tasks(4, "train", seed=1)
    with LargestTensor() as probe:
        rb = m.make_rollout_batch(tasks, seed=3)
        loss, stats = m.loss_on(rb, seed=3)
        loss.backward()
    rows, tokens = rb.completion_ids.shape
    full = rows * tokens * VOCAB
    assert stats["hint/rows"] == rows and stats["hint_distill/skipped"] == 0.0 and stats["replay/skipped"] == 0.0
    assert all(p.grad is not None for p in m.policy.parameters() if p.requires_grad)
    assert tokens >= 16 and rows * tokens > 2 * 256, (rows, tokens)  # the batch spans several LM-head chunks
    assert probe.numel * 2 <= full, f"largest tensor {probe.numel} ({probe.op}) vs rows×tokens×vocab {full}"

    # the detector sees the (rows, tokens, vocab) logits of the materialised path
    with LargestTensor() as probe_mat, torch.no_grad():
        ro = rb
        completion_forward(m.policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    assert probe_mat.numel >= full


def test_gradient_checkpointing_switch_keeps_loss_and_gradients(make_cfg, pairs_file):
    """``compute.gradient_checkpointing: layer`` recomputes each decoder layer in backward: same loss and gradients."""
    over = _losses("grpo", "jsd", None)
    cfg, _ = make_cfg(PARITY.format(pairs=pairs_file), *over)
    env = build_env(cfg)
    tasks = env.sample_tasks(3, "train", seed=5)
    out = {}
    for flag in ("none", "layer"):
        base, tok = load_policy_for(cfg, env)
        c, s = make_cfg(
            PARITY.format(pairs=pairs_file),
            *over,
            f"compute.gradient_checkpointing={flag}",
            "compute.micro_batch_size=4",
        )
        m = ComposerModule(c, policy=base, tokenizer=tok, env=env, src=s)
        m.train()
        assert base.is_gradient_checkpointing == (flag == "layer")
        rb = m.make_rollout_batch(tasks, 11)
        rb = rb.replace(advantages=torch.randn(rb.advantages.shape, generator=torch.Generator().manual_seed(0)))
        loss, _ = m.loss_on(rb, 11)
        loss.backward()
        out[flag] = (loss.detach(), _grads(m))
    torch.testing.assert_close(out["layer"][0], out["none"][0], rtol=1e-6, atol=1e-7)
    _close(out["layer"][1], out["none"][1], 1e-6)


def test_bf16_mixed_precision_trains_through_lightning(make_cfg, pairs_file):
    """``trainer.precision: bf16-mixed`` runs the step under Lightning's autocast (CPU here; a GPU in practice)."""
    from composer_plugins.training.runs.run import run_train

    cfg, src = make_cfg(
        PARITY.format(pairs=pairs_file),
        *PARITY_ROLLOUT,
        "trainer.precision=bf16-mixed",
        "trainer.max_steps=1",
        "trainer.checkpoint_every_n_steps=0",
    )
    res = run_train(cfg, src)
    row = res.history[-1]
    assert row["train/hint_distill/skipped"] == 0.0 and row["train/grpo/skipped"] == 0.0
    assert torch.isfinite(torch.tensor(row["train/loss"]))
