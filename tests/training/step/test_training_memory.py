"""What one composed step holds in memory (issue 48): per-layer checkpointing and no recompute when the step fits,
the optimizer's implementation, and at most two policy-sized weight copies in grpo + EMA hint teacher + replay DPO.

Bytes are measured on CPU with ``torch.autograd.graph.saved_tensors_hooks`` (the unique storages autograd keeps
for backward, parameters excluded), recomputation by counting decoder-layer forwards with module pre-hooks.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from composer_plugins.models.logprobs import completion_hidden, decoder_body, micro_batches, sequence_inputs
from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import load_policy_for

BASE = ("sft.enabled=false", "rollout.prompts_per_step=3", "rollout.num_generations=4", "rollout.max_new_tokens=10")
GRPO_ONLY = ("losses.hint_distill.enabled=false",)
FULL = """
replay: {{pairs_path: {pairs}, pairs_per_step: 3}}
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {{weight: 0.5, teacher: ema, ema_rate: 0.5}}
  replay: {{name: replay_dpo, weight: 0.3}}
"""


def _saved_bytes(fn, params=()):
    """``(fn(), bytes)``: the unique storages autograd saves for backward while ``fn`` runs (``params`` excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _batch(vocab: int, rows: int = 12, prompt: int = 8, completion: int = 24):
    g = torch.Generator().manual_seed(0)
    p_ids = torch.randint(3, vocab, (rows, prompt), generator=g)
    p_mask = torch.ones(rows, prompt, dtype=torch.long)
    p_mask[::3, :2] = 0  # left padding
    c_ids = torch.randint(3, vocab, (rows, completion), generator=g)
    c_mask = torch.ones(rows, completion, dtype=torch.long)
    c_mask[1::4, completion - 5 :] = 0
    return p_ids, p_mask, c_ids, c_mask


def _whole_body(model, batch, mb):
    """The step's body before issue 48: each micro-batch's whole decoder body under one checkpoint."""
    ids, att, pos = sequence_inputs(*batch)
    body, c = decoder_body(model), batch[2].shape[1]

    def run(i, a, p):
        return body(input_ids=i, attention_mask=a, position_ids=p, use_cache=False).last_hidden_state[:, -(c + 1) : -1]

    return torch.cat(
        [checkpoint(run, ids[s], att[s], pos[s], use_reentrant=False) for s in micro_batches(len(ids), mb)]
    )


def _per_layer_bytes(model, batch):
    """Saved bytes of each decoder layer's forward (no checkpointing) on ``batch``."""
    layers = decoder_body(model).layers
    where = {"at": None}
    per: dict[int, dict[int, int]] = {i: {} for i in range(len(layers))}
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: where.update(at=i)) for i, m in enumerate(layers)]
    hooks += [m.register_forward_hook(lambda *a: where.update(at=None)) for m in layers]

    def pack(t):
        if where["at"] is not None and not isinstance(t, torch.nn.Parameter):
            per[where["at"]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            completion_hidden(model, *batch)
    finally:
        for h in hooks:
            h.remove()
    return [sum(v.values()) for v in per.values()]


def _policy(make_cfg, *over):
    cfg, src = make_cfg("", *BASE, *over)
    env = build_env(cfg, src)
    policy, tok = load_policy_for(cfg, env)
    return cfg, src, env, policy, tok


def test_layer_checkpointing_holds_fewer_bytes_than_the_whole_body_and_keeps_gradients(make_cfg):
    """Several micro-batches: per-layer checkpointing (``auto``) holds each layer's input plus one layer's activations
    of one micro-batch at the peak; the whole body under one checkpoint held one micro-batch's activations of every
    layer. The gradients equal the plain (``none``) path's."""
    from composer_plugins.training.step.policy import apply_checkpointing

    cfg, _, _, plain, _ = _policy(make_cfg, "compute.micro_batch_size=3")
    model = copy.deepcopy(plain).train()
    assert apply_checkpointing(model, cfg) and model.is_gradient_checkpointing  # auto: 12 rows need 4 micro-batches
    params = list(model.parameters())
    batch = _batch(model.config.vocab_size)
    n_layers, hidden = len(decoder_body(model).layers), model.config.hidden_size

    # the whole body of one micro-batch (what the old path recomputed at once) vs one layer of one micro-batch
    one = tuple(t[:3] for t in batch)
    layer_bytes = _per_layer_bytes(plain.train(), one)
    _, body_bytes = _saved_bytes(lambda: completion_hidden(plain, *one), params)
    assert len(layer_bytes) == n_layers >= 2 and body_bytes >= sum(layer_bytes)

    new_out, new_fwd = _saved_bytes(lambda: completion_hidden(model, *batch, micro_batch_size=3), params)
    old_out, old_fwd = _saved_bytes(lambda: _whole_body(plain, batch, 3), params)
    rows, seq = batch[0].shape[0], batch[0].shape[1] + batch[2].shape[1]
    assert new_fwd >= n_layers * rows * seq * hidden * 4  # every layer's input is kept (it is measured)
    new_peak, old_peak = new_fwd + max(layer_bytes), old_fwd + body_bytes
    assert new_peak < old_peak, (new_peak, old_peak)

    # gradients: layer checkpointing == the plain path, micro-batched or not
    grads = {}
    for name, m, kw in (("layer", model, {"micro_batch_size": 3}), ("none", plain, {"micro_batch_size": 3})):
        m.zero_grad()
        completion_hidden(m, *batch, **kw).square().mean().backward()
        grads[name] = [p.grad.clone() for p in m.parameters()]
    plain.zero_grad()
    completion_hidden(plain, *batch).square().mean().backward()
    for a, b, c in zip(grads["layer"], grads["none"], [p.grad for p in plain.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
    del new_out, old_out


@pytest.mark.parametrize(
    ("over", "recomputed"),
    [
        (("compute.micro_batch_tokens=100000",), False),  # auto, one micro-batch: fits
        (("compute.micro_batch_size=2", "compute.gradient_checkpointing=none"), False),  # the switch
        (("compute.micro_batch_size=2",), True),  # auto, six micro-batches: per layer
    ],
)
def test_a_step_that_fits_runs_no_forward_twice(make_cfg, over, recomputed):
    cfg, src, env, policy, tok = _policy(make_cfg, *GRPO_ONLY, *over)
    m = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src).train()
    rec = m.make_rollout_batch(env.sample_tasks(3, "train", seed=1), seed=2)
    layers = decoder_body(policy).layers
    calls = [0]
    # pre-hooks: a recompute stops once it has what backward needs, before the forward hooks would run
    hooks = [lay.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1)) for lay in layers]
    try:
        loss, _ = m.loss_on(rec, seed=0)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    n_mb = len(micro_batches(rec.num_rows, m.step_policy().micro_batch(rec.prompt_ids, rec.completion_ids)))
    assert calls[0] == len(layers) * n_mb * (2 if recomputed else 1), (calls[0], len(layers), n_mb)
    assert policy.is_gradient_checkpointing == recomputed


def test_gradient_checkpointing_modes_and_the_deprecated_booleans(make_cfg):
    from composer_plugins.core.errors import ConfigError

    for value, mode in (("true", "layer"), ("false", "auto")):
        with pytest.warns(
            DeprecationWarning, match=f"compute.gradient_checkpointing: {value}.*write auto, layer or none"
        ):
            cfg, _ = make_cfg("", f"compute.gradient_checkpointing={value}")
        assert cfg.compute.gradient_checkpointing == mode
    with pytest.raises(ConfigError, match="compute.gradient_checkpointing"):
        make_cfg("", "compute.gradient_checkpointing=sometimes")


# -- the optimizer --------------------------------------------------------------------------------------------
def test_adamw_is_fused_on_cuda_and_foreach_elsewhere_with_the_reference_math():
    from composer_plugins.training.config.sections import OptimSection
    from composer_plugins.training.step.optim import build_optimizer, implementation_kwargs

    assert implementation_kwargs(torch.optim.AdamW, "auto", "cuda") == {"fused": True}
    assert implementation_kwargs(torch.optim.AdamW, "auto", "cpu") == {"foreach": True}
    assert implementation_kwargs(torch.optim.AdamW, False, "cuda") == {"fused": False}
    assert implementation_kwargs(lambda params, lr: None, "auto", "cuda") == {}  # takes neither: nothing
    g = torch.Generator().manual_seed(0)
    w0 = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    section = OptimSection(lr=0.1, weight_decay=0.01)
    ws = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = build_optimizer(section, ws)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"] is True and not opt.defaults["fused"]
    ref_ws = [torch.nn.Parameter(w.clone()) for w in w0]
    ref = torch.optim.AdamW(ref_ws, lr=0.1, weight_decay=0.01, foreach=False)
    for step in range(4):
        for params, o in ((ws, opt), (ref_ws, ref)):
            o.zero_grad()
            sum(((p - step) ** 2 * (i + 1)).sum() for i, p in enumerate(params)).backward()
            o.step()
    for a, b in zip(ws, ref_ws, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # optim.args win over the choice (no fused + foreach clash)
    opt = build_optimizer(dataclasses.replace(section, args={"foreach": False}), ws)
    assert opt.defaults["foreach"] is False


# -- weight copies of the full composition --------------------------------------------------------------------
def _large_storages(module, numel: int) -> dict[int, torch.Tensor]:
    """Distinct storages of at least ``numel`` elements reachable from ``module`` through its attributes."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [module]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel() >= numel:
                found.setdefault(obj.untyped_storage().data_ptr(), obj)
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, list | tuple | set):
            stack += list(obj)
        elif (
            hasattr(obj, "__dict__")
            and not isinstance(obj, type)
            and type(obj).__module__.split(".")[0]
            in (
                "composer_plugins",
                "torch",
                "transformers",
            )
        ):
            stack += list(vars(obj).values())
    return found


def _full(make_cfg, pairs_file, *over):
    cfg, src = make_cfg(FULL.format(pairs=pairs_file), *BASE, *over)
    env = build_env(cfg, src)
    policy, tok = load_policy_for(cfg, env)
    return ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src), env


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_full_composition_holds_at_most_two_policy_copies(make_cfg, pairs_file, precision, dtype):
    m, env = _full(make_cfg, pairs_file, f"trainer.precision={precision}")
    largest = max(p.numel() for p in m.policy.parameters())
    big = _large_storages(m, largest)
    assert len(big) == 2, [(t.shape, t.dtype) for t in big.values()]  # the policy's and the EMA teacher's
    assert m.reference is None and m.ema_teacher is not None
    assert {p.dtype for p in m.ema_teacher.parameters()} == {dtype}
    assert {p.dtype for p in m.policy.parameters()} == {torch.float32}
    # buffers (rotary frequencies) keep the policy's dtype
    assert [b.dtype for b in m.ema_teacher.buffers()] == [b.dtype for b in m.policy.buffers()]
    # the composed step runs with the teacher in that dtype (under the precision's autocast)
    rec = m.make_rollout_batch(env.sample_tasks(3, "train", seed=1), seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "32-true"):
        loss, stats = m.loss_on(rec, seed=0)
    loss.backward()
    assert torch.isfinite(loss) and stats["hint/rows"] > 0 and stats["replay/pairs"] > 0
    assert all(p.grad is not None for p in m.policy.parameters())


def test_replay_reference_logprobs_are_the_starting_policys_cached_with_the_pair_and_resumed(make_cfg, pairs_file):
    from composer_plugins.training.step.assemble import assemble_inputs
    from composer_plugins.training.step.input_builders import PAIR_REF_KEYS

    m, env = _full(make_cfg, pairs_file)
    start = copy.deepcopy(m.policy).eval()
    rec = m.make_rollout_batch(env.sample_tasks(3, "train", seed=1), seed=2)

    def ref_inputs(module, reference=None):
        meta = module.step_meta(seed=5)
        pol = dataclasses.replace(module.step_policy(), reference=reference)
        inputs, _ = assemble_inputs(rec, module.composer, pol, meta=meta)
        return inputs[PAIR_REF_KEYS[0]], inputs[PAIR_REF_KEYS[1]]

    want = ref_inputs(m)  # computed now from the starting policy and kept with the pairs
    assert all(isinstance(p[k], float) for p in m.parts.pairs for k in PAIR_REF_KEYS)
    with torch.no_grad():
        for p in m.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    got = ref_inputs(m)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # the cache: not the moved policy's
    # a step record with a reference copy passed explicitly gives the same values from the copy (uncached pairs)
    fresh, _ = _full(make_cfg, pairs_file)
    fresh.parts.pair_refs_due = False
    for a, b in zip(ref_inputs(fresh, reference=start), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # resume: the checkpoint carries them (a module rebuilt on other weights restores, not recomputes, them)
    ckpt: dict = {}
    m.on_save_checkpoint(ckpt)
    other, _ = _full(make_cfg, pairs_file)
    with torch.no_grad():
        for p in other.policy.parameters():
            p.mul_(0.5)
    other.on_load_checkpoint(ckpt)
    assert other.parts.pairs == m.parts.pairs and not other.parts.pair_refs_due


def test_ema_teacher_head_is_not_copied_and_the_margin_stat_is_opt_in(make_cfg, pairs_file):
    from composer_plugins.models.logprobs import lm_head_weight

    m, env = _full(make_cfg, pairs_file)
    rec = m.make_rollout_batch(env.sample_tasks(3, "train", seed=1), seed=2)
    assert rec.hint_rows
    c = (rec.completion_ids[:2], rec.completion_mask[:2])
    _, head = m.ema_teacher(rec.prompt_ids[:2], rec.prompt_mask[:2], *c)
    assert head.untyped_storage().data_ptr() == lm_head_weight(m.ema_teacher.policy).untyped_storage().data_ptr()
    with torch.no_grad():
        _, stats = m.loss_on(rec, seed=0)
    assert stats["hint/rows"] > 0 and "hint/teacher_margin" not in stats
    on, _ = _full(make_cfg, pairs_file, "hints.teacher_margin=true")
    with torch.no_grad():
        _, stats = on.loss_on(rec, seed=0)
    assert "hint/teacher_margin" in stats
