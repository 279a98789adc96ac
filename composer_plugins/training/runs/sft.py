"""The supervised warm start (``sft``): its data, its Lightning module and its training run.

:func:`sft_pairs` draws ``(prompt, worked solution)`` pairs, hinting ``sft.hint_fraction`` of them;
:class:`SFTModule` trains on the solution tokens only; :func:`sft_train` writes a ``save_pretrained``
directory. Which warm start a run uses (and its cache): :mod:`composer_plugins.training.step.policy`.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import read_jsonl
from composer_plugins.envs.arith import dropped_carry
from composer_plugins.envs.hints import build_hint_provider, reads_groups, sibling_groups
from composer_plugins.envs.step_check import false_step_attempt
from composer_plugins.losses.functional import chunked_logprobs
from composer_plugins.models.logprobs import decoder_body, lm_head_weight
from composer_plugins.models.tiny import load_policy
from composer_plugins.training.config.train import TrainConfig
from composer_plugins.training.lightning.trainer import lightning_trainer, progress_bar, quiet_lightning, set_threads
from composer_plugins.training.rollout.chat import install_chat_template
from composer_plugins.training.rollout.rewards import (
    derive_seed,
    env_tasks,
    reference_completion,
    task_prompt,
    teacher_contexts,
)
from composer_plugins.training.step.optim import build_optimizer, warmup_cosine


def sft_pairs(env: Any, cfg: TrainConfig, tokenizer: Any = None) -> list[tuple[str, str]]:
    """``(prompt, solution)`` pairs for the SFT warm start from the env's train generator.

    The prompts are the text the model reads (chat messages rendered for ``tokenizer`` with
    ``model.chat_template``, :mod:`composer_plugins.training.rollout.chat`), as in the RL rollouts.
    """
    if cfg.data.train_path:
        tasks = read_jsonl(cfg.data.train_path)[: cfg.sft.num_examples]
    else:
        tasks = env_tasks(env, cfg.data.train_split, cfg.sft.num_examples, derive_seed(cfg.sft.seed, 77))
    out = []
    for t in tasks:
        sol = reference_completion(t)
        if sol is None:
            raise ConfigError(
                "the env's tasks carry no worked 'solution'; SFT needs one. HINT: set sft.enabled=false "
                "and start from an already fine-tuned model.name_or_path",
                key="sft.enabled",
            )
        out.append((task_prompt(t, tokenizer, cfg.model.chat_template), str(sol)))
    plain = list(out)
    if cfg.sft.hint_fraction > 0 and cfg.hints.provider is not None:
        out = _hint_augment(env, cfg, tasks, out, tokenizer)
    if cfg.sft.slip_rate > 0:
        out = _slip(cfg, plain, out)
    return out


def _slip(cfg: TrainConfig, plain: Sequence[tuple[str, str]], pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``sft.slip_rate`` of the plain rows that can slip, their target given with the slip (hinted rows kept)."""
    rng = random.Random(derive_seed(cfg.sft.seed, 93))
    out, can = list(pairs), 0
    for i, ((prompt, target), (plain_prompt, _)) in enumerate(zip(pairs, plain, strict=True)):
        draw = rng.random()  # one draw a row, so the slipped rows do not depend on which others can slip
        slipped = dropped_carry(target) if prompt == plain_prompt else None
        if slipped is None:
            continue
        can += 1
        if draw < cfg.sft.slip_rate:
            out[i] = (prompt, slipped)
    if not can:
        raise ConfigError(
            "sft.slip_rate > 0, but none of the plain SFT demonstrations has a slip to make: the slip is the column "
            "levels' dropped carry (env gsm8k, difficulty columns or long_columns). HINT: set sft.slip_rate=0",
            key="sft.slip_rate",
        )
    return out


def _wrong_attempt(task: Mapping[str, Any], rng: random.Random) -> str | None:
    """A plausible wrong final answer for a task with a numeric ``answer`` (``None`` otherwise)."""
    try:
        value = int(str(task.get("answer")))
    except (TypeError, ValueError):
        return None
    delta = rng.choice([d for d in range(-10, 11) if d != 0])
    return f"#### {value + delta}"


def _provider_name(spec: Any) -> str | None:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return str(spec.get("name")) if spec.get("name") is not None else None
    return getattr(spec, "name", None)


def sft_hint_kinds(cfg: TrainConfig) -> dict[str, float]:
    """``sft.hint_kinds`` as shares summing to 1 (the default follows ``hints.provider``)."""
    kinds = cfg.sft.hint_kinds
    if kinds is None:
        kinds = {"demonstration": 1.0} if _provider_name(cfg.hints.provider) == "demonstration" else {"feedback": 1.0}
    total = float(sum(kinds.values()))
    return {k: float(v) / total for k, v in kinds.items() if v > 0}


def _hint_augment(
    env: Any, cfg: TrainConfig, tasks: Sequence[Mapping[str, Any]], pairs: list[tuple[str, str]], tokenizer: Any = None
) -> list[tuple[str, str]]:
    """Replace ``sft.hint_fraction`` of the prompts by hinted teacher contexts for a wrong attempt.

    Each hinted example is of one kind (``sft.hint_kinds``): ``feedback``, the provider's hint for
    the wrong attempt; ``step_check``, the worked solution with one false step as the attempt and the
    ``step_check`` hint naming it (tasks whose solution states equations); or ``demonstration``, the
    rollout group ``(wrong attempt, worked solution)`` given to a provider that reads groups
    (``hints.provider`` if it does, else the default ``demonstration`` provider), so the context shows
    the problem's worked solution as a successful sibling. The target stays the worked solution.
    """
    rng = random.Random(derive_seed(cfg.sft.seed, 91))
    picked = [i for i in range(len(pairs)) if rng.random() < cfg.sft.hint_fraction]
    attempts = {i: _wrong_attempt(tasks[i], rng) for i in picked}
    picked = [i for i in picked if attempts[i] is not None]
    if not picked:
        return pairs
    shares = sft_hint_kinds(cfg)
    names, weights = list(shares), list(shares.values())
    if len(names) == 1:
        kind = dict.fromkeys(picked, names[0])
    else:  # drawn from their own stream, so {feedback: 1} keeps today's examples exactly
        krng = random.Random(derive_seed(cfg.sft.seed, 92))
        kind = {i: krng.choices(names, weights)[0] for i in picked}
    provider = build_hint_provider(cfg.hints.provider, key="hints.provider")
    out = list(pairs)

    def hint(by: Any, rows: list[int], tried: Mapping[int, Any], **kw: Any) -> None:
        kw.update(tokenizer=tokenizer, chat_template=cfg.model.chat_template)
        ctxs = teacher_contexts(env, by, [tasks[i] for i in rows], [str(tried[i]) for i in rows], **kw)
        for i, ctx in zip(rows, ctxs, strict=True):
            if ctx is not None:
                out[i] = (ctx, pairs[i][1])

    fb_rows = [i for i in picked if kind[i] == "feedback"]
    if fb_rows:
        hint(provider, fb_rows, attempts)
    step_rows = [i for i in picked if kind[i] == "step_check"]
    if step_rows:  # a worked attempt with one false step, hinted by step_check (envs/step_check.py)
        sc = (
            provider
            if _provider_name(cfg.hints.provider) == "step_check"
            else build_hint_provider({"name": "step_check", "fallback": "none"}, key="sft.hint_kinds")
        )
        wrong = {i: false_step_attempt(pairs[i][1], rng) for i in step_rows}
        hint(sc, [i for i in step_rows if wrong[i] is not None], wrong)
    demo_rows = [i for i in picked if kind[i] == "demonstration"]
    if demo_rows:
        demo = provider if reads_groups(provider) else build_hint_provider("demonstration", key="sft.hint_kinds")
        groups = []
        for i in demo_rows:  # the wrong attempt fails, the worked solution succeeds
            groups += sibling_groups([str(attempts[i]), pairs[i][1]], [0.0, 1.0], 2, 1.0)[:1]
        hint(demo, demo_rows, attempts, groups=groups)
    return out


class SFTModule(L.LightningModule):
    """Supervised warm start: next-token cross-entropy on the completion part of ``prompt + solution``."""

    def __init__(
        self,
        policy: Any,
        tokenizer: Any,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        total_steps: int = 1,
    ) -> None:
        super().__init__()
        # from_pretrained returns eval mode; Lightning trains modules in the mode it finds them in
        self.policy = policy.train()
        self.tokenizer = tokenizer
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.total_steps = warmup_steps, max(1, total_steps)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        """Token-mean cross-entropy over the labelled tokens, chunked through the LM head from hidden states."""
        body = decoder_body(self.policy)
        hidden = body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        logps = chunked_logprobs(
            hidden.last_hidden_state[:, :-1], lm_head_weight(self.policy), labels.clamp(min=0), mask=mask
        )
        assert isinstance(logps, Tensor)
        loss = -logps.sum() / mask.sum().clamp(min=1)
        self.log("sft/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        sft_optim = SimpleNamespace(name="adamw", lr=self.lr, weight_decay=self.weight_decay)
        opt = build_optimizer(sft_optim, self.policy.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(self.warmup_steps, self.total_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def sft_collate(tokenizer: Any, examples: Sequence[tuple[str, str]], max_length: int = 256) -> dict[str, Tensor]:
    """Right-padded ``prompt + completion + EOS`` with labels ``-100`` on prompt and padding."""
    pad = tokenizer.pad_token_id
    rows, labels = [], []
    for prompt, completion in examples:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p + c)[:max_length])
        labels.append(([-100] * len(p) + c)[:max_length])
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    lab_t = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        lab_t[i, : len(lab)] = torch.tensor(lab)
    return {"input_ids": input_ids, "attention_mask": attn, "labels": lab_t}


@quiet_lightning()
def sft_train(
    cfg: TrainConfig, base: str, env: Any, out_dir: str | os.PathLike[str], extra_callbacks: Sequence[Any] = ()
) -> dict[str, float]:
    """Supervised warm start of ``base`` on the env's solutions; ``save_pretrained`` to ``out_dir``."""
    set_threads(cfg)
    model, tok = load_policy(base, dtype=cfg.model.dtype)
    install_chat_template(tok, cfg.model.chat_template)
    pairs = sft_pairs(env, cfg, tok)
    s = cfg.sft
    gen = torch.Generator().manual_seed(s.seed)
    loader = torch.utils.data.DataLoader(
        pairs,
        batch_size=s.batch_size,
        shuffle=True,
        generator=gen,
        collate_fn=lambda b: sft_collate(tok, b, s.max_length),
        drop_last=True,
    )
    module = SFTModule(
        model, tok, lr=s.lr, weight_decay=s.weight_decay, warmup_steps=s.warmup_steps, total_steps=s.steps
    )
    L.seed_everything(s.seed, verbose=False)
    history: list[dict[str, float]] = []

    class _Losses(Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            loss = trainer.callback_metrics.get("sft/loss")
            if loss is not None:
                history.append({"step": int(trainer.global_step), "sft/loss": float(loss)})

    bar = progress_bar("sft", s.progress)
    trainer = lightning_trainer(
        max_steps=s.steps,
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        precision=cfg.trainer.precision,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        callbacks=[_Losses(), *extra_callbacks, *([bar] if bar else [])],
    )
    try:
        with quiet_lightning():
            trainer.fit(module, train_dataloaders=loader)
    except SystemExit:  # Lightning's answer to Ctrl-C: tear down, then sys.exit(1)
        if not trainer.interrupted:
            raise
        raise KeyboardInterrupt from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if hasattr(v, "item")}
    (out / "sft_metrics.json").write_text(json.dumps(final, indent=2))
    (out / "sft_history.json").write_text(json.dumps(history))
    return final
