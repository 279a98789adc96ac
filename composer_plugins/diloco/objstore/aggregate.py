"""A round's close and aggregate: the manifest (who took part), the mean pseudo-gradient made slice by slice
through the store (a reduce-scatter), and the outer step it feeds."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.codecs import get_codec
from composer_plugins.diloco.objstore.rounds import slice_bounds

log = logging.getLogger(__name__)


class AggregateMixin:
    """Closing a round, making and reading its stored mean, and the outer step, for
    :class:`~composer_plugins.diloco.objstore.ObjectStoreDiLoCoCallback`."""

    def _apply_round(
        self, r: int, manifest: dict[str, Any], own: torch.Tensor | None, *, mix_local: bool, live: bool = True
    ) -> bool:
        """Take round ``r``'s outer step with its stored mean pseudo-gradient (:meth:`_round_mean`) from the global
        state of round ``r - 1`` held here. ``False`` (nothing changed) when the mean cannot be had."""
        mean = self._round_mean(r, manifest, own)
        if mean is None:
            return False
        self._outer_step(mean, mix_local=mix_local, live=live)
        self._at_round(r + 1)
        return True

    def _round_mean(self, r: int, manifest: dict[str, Any], own: torch.Tensor | None) -> torch.Tensor | None:
        """Round ``r``'s mean pseudo-gradient as stored, slice by slice (docs/diloco.md, "One aggregate per round");
        ``own``: this replica's pseudo-gradient (``None``: a closed round rebuilt, no waiting for slice owners).
        ``None`` when a round rebuilt later lacks a listed slice."""
        c, rs, me = self.config, self.rounds, self.replica.index
        parts = list(manifest["participants"])
        numel = sum(p.numel() for p in self.params)
        bounds = slice_bounds(numel, int(manifest["slices"]))
        indexes: dict[int, dict[str, Any] | None] = {}
        out: dict[int, torch.Tensor] = {}
        codec = get_codec(c.compress)
        #: what the mean is written with: a sparse codec's mean (the union of the replicas' entries) stays sparse
        mean_codec = getattr(codec, "mean_codec", None) or c.compress

        def make(j: int) -> torch.Tensor | None:
            lo, hi = bounds[j]
            total, count = torch.zeros(hi - lo), 0
            for i in parts:
                name = manifest["grads"][str(i)]
                if i == me and own is not None:
                    vec: torch.Tensor | None = own[lo:hi]
                else:
                    if i not in indexes:
                        indexes[i] = rs.read_grad_index(r, name, numel)
                    idx = indexes[i]
                    vec = None if idx is None else rs.read_grad_slice(r, name, idx, j)
                if vec is None:
                    if own is None or self._round_settled(r):
                        # a closed round rebuilt later, or one whose participants applied its mean and moved on
                        # (``keep_rounds`` collected its pseudo-gradients and mean): a mean made here would lack
                        # members the round closed with, so nothing is written (the caller takes a newer state)
                        log.warning(
                            "DiLoCo round %d: slice %d of replica %d's pseudo-gradient is gone and the round "
                            "was settled without this replica; not making a partial mean",
                            r,
                            j,
                            i,
                        )
                        return None
                    # the round is live (nobody has applied it: no state of it or later exists, so its mean was
                    # never written and collected): the one mean everyone applies leaves that slice out
                    log.warning(
                        "DiLoCo round %d: slice %d of replica %d's pseudo-gradient is unreadable; left out of "
                        "that slice of the mean",
                        r,
                        j,
                        i,
                    )
                    continue
                total = vec.clone() if count == 0 else total.add_(vec)
                count += 1
            mean = total.div_(max(count, 1))
            # error feedback on the mean's own rounding (a lossy codec): what the stored mean of this slice left out
            # is added to the next mean of it this replica writes, on that mean's entries only (the rest waits for a
            # mean that has them): the mean of sparse updates keeps their support, so it stays sparse where that is
            # smaller (the rounding error of every entry ever sent would make every later mean dense)
            key = (j, hi - lo)
            carry = self._mean_residual.pop(key, None) if codec.error_feedback else None
            held = None
            if carry is not None:
                on = mean != 0
                want, held = mean + torch.where(on, carry, 0.0), torch.where(on, 0.0, carry)
            else:
                want = mean
            stored, created = rs.put_mean(r, j, want, mean_codec, count)
            if created and codec.error_feedback:
                self._mean_residual[key] = want - stored if held is None else held.add_(want - stored)
            elif held is not None:  # another writer's mean: this carry stays for the next one written here
                self._mean_residual[key] = carry
            return stored

        if own is not None:
            for j in range(len(bounds)):
                if parts[j % len(parts)] == me:
                    if (got := make(j)) is None:
                        return None
                    out[j] = got
        deadline = time.monotonic() + (c.round_timeout_s if own is not None else 0.0)
        delay = c.poll_s
        while len(out) < len(bounds):
            for j in range(len(bounds)):
                if j not in out and (got := rs.get_mean(r, j, bounds[j][1] - bounds[j][0])) is not None:
                    out[j] = got
            if len(out) == len(bounds):
                break
            if time.monotonic() >= deadline:
                for j in range(len(bounds)):
                    if j not in out:
                        if own is not None:
                            log.warning(
                                "DiLoCo round %d: slice %d of the mean not written by its owner within "
                                "round_timeout_s; computing it here",
                                r,
                                j,
                            )
                        if (got := make(j)) is None:
                            return None
                        out[j] = got
                break
            time.sleep(delay)
            delay = min(delay * 1.5, c.poll_max_s)
        return torch.cat([out[j] for j in range(len(bounds))])

    def _round_settled(self, r: int) -> bool:
        """Whether round ``r`` was applied by its participants: a global state of it or a later round exists.

        ``keep_rounds`` deletes a round's pseudo-gradients and mean only after a newer state is written (and keeps
        that state), so a listed pseudo-gradient that is gone while no such state exists was never collected."""
        return any(k >= r for k in self.rounds.state_rounds())

    def _close(self, r: int, me: int, mine_name: str | None) -> tuple[dict[str, Any], bool]:
        """Wait for the others' pseudo-gradients (their indexes only) up to the deadline, then close the round or
        read its manifest."""
        c, rs, n = self.config, self.rounds, self.replica.num_replicas
        numel = sum(p.numel() for p in self.params)
        deadline = time.monotonic() + c.round_timeout_s
        good: dict[int, str] = {}
        refused: set[str] = set()
        delay = c.poll_s
        while True:
            m = rs.manifest(r)
            if m is not None:
                return m, False
            for i, names in rs.grads_present(r).items():
                for name in names:  # the newest readable one of each replica
                    if name == good.get(i):
                        break
                    if name in refused:
                        continue
                    if not (i == me and name == mine_name) and rs.read_grad_index(r, name, numel) is None:
                        refused.add(name)
                        continue
                    good[i] = name
                    break
            # a replica that said it has nothing for this round (refused-<i>) is not waited for
            if len(good) < n:
                said = {**self._stopped, **rs.refused(r)}
                self._stopped.update({i: why for i, why in said.items() if why.startswith("stopped")})
                said = {i: why for i, why in said.items() if i not in good}
            else:
                said = {}
            if len(good) + len(said) >= n and not good:
                raise ComposerPluginsError(
                    f"round {r}: no replica has a pseudo-gradient ({rs.store.where}/{rs.round_dir(r)}): "
                    + "; ".join(f"replica {i}: {why}" for i, why in sorted(said.items()))
                    + ". HINT: a codec at fault is named above (diloco.compress); non-finite pseudo-gradients: "
                    "lower the learning rate."
                )
            if len(good) + len(said) >= n or (good and time.monotonic() > deadline):
                missing = sorted(set(range(n)) - set(good))
                if missing:
                    log.warning("DiLoCo round %d: closing without replica(s) %s (missing, late or refused)", r, missing)
                return rs.close_round(r, good, me, slices=n)
            if not good and time.monotonic() > deadline + c.round_timeout_s:
                raise ComposerPluginsError(
                    f"round {r}: no readable pseudo-gradient in {rs.store.where}/{rs.round_dir(r)} within "
                    f"2 x diloco.round_timeout_s={c.round_timeout_s:.0f}s. HINT: see the log for the refused objects."
                )
            time.sleep(delay)
            delay = min(delay * 1.5, c.poll_max_s)

    @torch.no_grad()
    def _outer_step(self, avg: torch.Tensor, *, mix_local: bool = True, live: bool = True) -> None:
        """The outer step torchft's ``_StreamingDiLoCoFragment.perform_sync`` applies, on the averaged vector:
        the outer optimizer steps the global weights with it as their gradient; then (``live``: not the background
        sync of ``overlap: 1``) the model takes them, mixed with its local ones by ``fragment_update_alpha``
        (``mix_local``: not a round rebuilt)."""
        off = 0
        for g in self.global_params:
            n = g.numel()
            g.grad = avg[off : off + n].view_as(g).to(device=g.device, dtype=g.dtype)
            off += n
        opt = self.outer_optimizers[0]
        opt.step()
        opt.zero_grad()
        if not live:
            return
        for p, g in zip(self.params, self.global_params, strict=True):
            if mix_local:
                loc = p.detach().clone()
                p.copy_(g)
                p.lerp_(loc, self.config.fragment_update_alpha)
            else:
                p.copy_(g)
