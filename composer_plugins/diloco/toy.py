"""The toy target of DiLoCo (``--target toy``): a tiny causal LM on a synthetic Markov chain (tests, benchmark,
smoke runs); the ``toy:`` keys are in docs/diloco.md, "Quick start".
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from composer_plugins.core.config import Config, from_dict
from composer_plugins.diloco.common import ReplicaInfo, param_digest
from composer_plugins.diloco.replica import diloco_callback_from_config


@dataclasses.dataclass
class ToyConfig:
    """The ``toy:`` section of the built-in toy target (a tiny causal LM on a synthetic Markov chain)."""

    vocab_size: int = 32
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    seq_len: int = 24
    batch_size: int = 16
    branching: int = 3
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_steps: int = 64
    seed: int = 0
    data_seed: int = 1234
    eval_batches: int = 8
    output: str | None = None  #: JSON summary path; ``{replica}`` becomes the replica index
    threads: int = 1

    def validate(self, src: Config | None = None, key: str = "toy") -> ToyConfig:
        """Refuse sizes the toy model cannot be built with, located at ``key.<field>`` in ``src``."""
        src = src if src is not None else Config()
        sizes = ("vocab_size", "d_model", "n_heads", "n_layers", "seq_len", "batch_size", "branching")
        for name in (*sizes, "eval_batches", "threads"):
            if getattr(self, name) < 1:
                raise src.error(f"{key}.{name}", f"must be >= 1, got {getattr(self, name)}.")
        if self.max_steps < 0:
            raise src.error(f"{key}.max_steps", f"must be >= 0, got {self.max_steps}.")
        if self.d_model % self.n_heads:
            raise src.error(f"{key}.n_heads", f"must divide d_model ({self.d_model}), got {self.n_heads}.")
        if self.branching > self.vocab_size:
            raise src.error(
                f"{key}.branching", f"must be at most vocab_size ({self.vocab_size}), got {self.branching}."
            )
        if not self.lr > 0:
            raise src.error(f"{key}.lr", f"must be > 0, got {self.lr}.")
        return self


class ToyMarkovStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Endless batches of token sequences from a fixed random sparse Markov chain (``chain_seed``: every replica's;
    ``sample_seed``: this replica's shard). The best achievable loss is about ``log(branching)``."""

    def __init__(
        self, vocab_size: int, seq_len: int, batch_size: int, branching: int, chain_seed: int, sample_seed: int
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(chain_seed)
        probs = torch.zeros(vocab_size, vocab_size)
        for v in range(vocab_size):
            succ = torch.randperm(vocab_size, generator=g)[:branching]
            probs[v, succ] = torch.rand(branching, generator=g) + 0.5
        self.transition = probs / probs.sum(-1, keepdim=True)
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.sample_seed = sample_seed

    def batches(self, n: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.sample_seed)
        for _ in range(n) if n is not None else itertools.count():
            tok = torch.randint(self.vocab_size, (self.batch_size,), generator=g)
            seq = [tok]
            for _ in range(self.seq_len):
                tok = torch.multinomial(self.transition[tok], 1, generator=g).squeeze(1)
                seq.append(tok)
            yield {"input_ids": torch.stack(seq, 1)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.batches()


class ToyCausalLM(pl.LightningModule):
    """A one-block causal transformer LM (a few thousand parameters); AdamW inner optimizer."""

    def __init__(
        self,
        vocab_size: int = 32,
        d_model: int = 32,
        n_heads: int = 2,
        n_layers: int = 1,
        seq_len: int = 24,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len + 1, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        h = self.embed(input_ids) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        for blk in self.blocks:
            h = blk(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))

    def loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=(0.9, 0.95)
        )


def toy_model(toy: ToyConfig) -> ToyCausalLM:
    return ToyCausalLM(toy.vocab_size, toy.d_model, toy.n_heads, toy.n_layers, toy.seq_len, toy.lr, toy.weight_decay)


def toy_stream(toy: ToyConfig, shard: int, eval: bool = False) -> ToyMarkovStream:
    sample_seed = 10_000_019 + toy.data_seed if eval else toy.data_seed * 1000 + 7919 * (shard + 1)
    return ToyMarkovStream(toy.vocab_size, toy.seq_len, toy.batch_size, toy.branching, toy.data_seed, sample_seed)


@torch.no_grad()
def toy_eval_loss(model: ToyCausalLM, toy: ToyConfig) -> float:
    """Mean loss on ``eval_batches`` held-out batches (the same for every replica)."""
    model.eval()
    losses = [float(model.loss(b)) for b in toy_stream(toy, 0, eval=True).batches(toy.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def run_toy(cfg: Config | Mapping[str, Any] | None = None, *, extra_callbacks: Sequence[pl.Callback] = ()) -> dict:
    """Train the toy LM as one replica (DiLoCo when a lighthouse or a store is known); returns a small summary.
    The seed is ``$COMPOSER_DILOCO_SEED`` (else ``toy.seed + index``), the data shard the replica index."""
    c = cfg if isinstance(cfg, Config) else Config(dict(cfg or {}))
    toy = from_dict(ToyConfig, c.get("toy") or {}, c, "toy").validate(c, "toy")
    torch.set_num_threads(max(1, toy.threads))
    cb = diloco_callback_from_config(c)
    replica = cb.replica if cb is not None else ReplicaInfo.from_env()
    seed = replica.seed if replica.seed is not None else toy.seed + replica.index
    pl.seed_everything(seed, verbose=False)
    model = toy_model(toy)
    loader = torch.utils.data.DataLoader(toy_stream(toy, replica.index), batch_size=None)
    callbacks = [*extra_callbacks, *([cb] if cb is not None else [])]
    from composer_plugins.training.lightning.trainer import lightning_trainer

    trainer = lightning_trainer(accelerator="cpu", devices=1, max_steps=toy.max_steps, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    out = {
        "replica": replica.index,
        "restart": replica.restart,
        "seed": seed,
        "inner_steps": trainer.global_step,
        "tokens": trainer.global_step * toy.batch_size * toy.seq_len,
        "eval_loss": toy_eval_loss(model, toy),
        "param_hash": param_digest(model.parameters())[0],
        "outer_step": cb.history[-1]["outer_step"] if cb is not None and cb.history else 0,
        "bytes_allreduced": cb.bytes_allreduced if cb is not None else 0,
        "heal_count": cb.heal_count if cb is not None else 0,
        "num_params": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - t0,
    }
    if toy.output:
        path = Path(toy.output.replace("{replica}", str(replica.index)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out))
    return out
