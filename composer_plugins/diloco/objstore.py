"""DiLoCo whose outer sync travels through an object store (``diloco.transport: object_store``).

Replicas never talk to each other: the store (``diloco.store``, an S3/GCS/Azure prefix or ``file://``) is
their only meeting point, so they can run as serverless jobs in places that cannot open ports to each
other. Layout of the run directory::

    run.json                          who the run is: run id, replicas, parameter shapes and every setting the
                                      replicas must share (H, codec, outer and inner optimizer); a second run,
                                      or a replica with other settings, is refused naming what differs
    init                              replica 0's state at the first sync (``init_sync``: everyone starts from it)
    rounds/<r>/grad-<i>-<k>.s<j>      slice j of replica i's pseudo-gradient for round r (codec + SHA-256)
    rounds/<r>/grad-<i>-<k>           its index (slice bounds and checksums), created after the slices
    rounds/<r>/manifest.json          the participants of round r, created once (If-None-Match)
    rounds/<r>/mean-<j>               slice j of round r's mean pseudo-gradient (the run's codec), created once
    state/<r>                         the global weights and outer optimizer state after round r

Every object but the pseudo-gradient slices (which their index's checksums name) carries the run id; an object of
another run is refused with an error naming it, and a run never starts on a prefix that holds another run's
objects, whether or not that run's ``run.json`` is still there.

A round, on every replica: write the pseudo-gradient (``global - local``, encoded with ``diloco.compress``);
wait until every replica's is there or ``diloco.round_timeout_s`` has passed; then the first replica to try
creates the round manifest, listing the pseudo-gradients whose index it read intact (a torn or corrupt one
fails its checksum and counts as missing). The create is conditional, so there is exactly one manifest per
round. The round's mean is then made slice by slice (a reduce-scatter through the store): participant
``participants[j % P]`` reads slice ``j`` of the others' pseudo-gradients, averages them with its own in
index order and creates ``mean-<j>`` (anyone creates a slice its owner has not written in time); every replica
applies the stored mean (identical bits whoever wrote it), so it reads about ``2 (N-1)/N`` compressed
pseudo-gradients per round, never its own, and takes the same outer step
(:func:`~composer_plugins.diloco.common.build_outer_optimizer`, the torchft path's optimizer; the same
restore / ``grad`` / ``step`` / ``lerp`` sequence as ``torchft.local_sgd``). The replica that created the
manifest writes the new global state. With ``diloco.overlap: 1`` the close, the mean and the outer step
(on the global weights) of round ``r`` run in a background thread during round ``r + 1``'s inner steps, and
the model takes their result one round late (:meth:`ObjectStoreDiLoCoCallback._finish_overlapped`).

Faults: a replica that missed the deadline (the manifest exists without it) drops its local steps and
loads the newest global state; a replica the launcher restarted loads it before training and reports
``"healed": true`` at its first sync; store errors are retried with bounded backoff
(:class:`~composer_plugins.diloco.store.ObjectStore`). With ``init_sync`` (default) the first round
reproduces torchft's: every replica takes replica 0's model and inner-optimizer state at the first sync,
so without faults an ``object_store`` run equals a ``torchft`` run of the same config and seeds.

The sync log has the torchft path's fields (``outer_step``, ``committed``, ``participants``, ``healed``,
``param_hash`` ...) plus ``transport``, ``bytes_written``, ``bytes_read``, ``compress_error``,
``sync_seconds`` and ``store_retries`` (store requests retried during the sync).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import time
from typing import Any

import torch
from torch import nn

from composer_plugins.core.errors import ComposerPluginsError, ConfigError, one_line
from composer_plugins.diloco import env as _env
from composer_plugins.diloco.codecs import get_codec
from composer_plugins.diloco.common import (
    DiLoCoConfig,
    ReplicaInfo,
    build_outer_optimizer,
    param_digest,
    split_fragments,
    stop_file_says_stop,
)
from composer_plugins.diloco.glue import DiLoCoCallbackBase
from composer_plugins.diloco.store import (
    CorruptObjectError,
    ObjectStore,
    decode_tree,
    decode_vector,
    encode_tree,
    encode_vector,
    pack,
    redact_url,
    to_host,
    unpack,
)
from composer_plugins.diloco.transports import get_transport

log = logging.getLogger(__name__)

__all__ = ["ObjectStoreDiLoCoCallback", "RoundStore", "StoreObjectError"]

_GRAD = re.compile(r"grad-(\d+)-(\d+)$")
#: objects that carry no run id of their own: a pseudo-gradient's slices (its index's checksums name them) and the
#: blob behind a large object (its reference names it)
_UNNAMED = re.compile(r"\.(s\d{3}|blob-[0-9a-f]+)$")
#: how many names ``grad-<i>-<k>`` a replica tries past its restart count (an older life or launch took some)
_GRAD_TRIES = 64


def slice_bounds(numel: int, slices: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of ``slices`` contiguous slices of a flat vector of ``numel`` values (the last may be short)."""
    step = -(-numel // slices) if numel else 0
    return [(min(j * step, numel), min((j + 1) * step, numel)) for j in range(slices)]


def encode_slices(
    vec: torch.Tensor, compress: str, slices: int
) -> tuple[list[tuple[dict[str, Any], bytes]], torch.Tensor]:
    """Each slice of ``vec`` (see :func:`slice_bounds`) encoded on its own, and the decoded whole: what the others
    read (so the sender can keep the rounding error, and average exactly what they see)."""
    out, decoded = [], []
    for lo, hi in slice_bounds(vec.numel(), slices):
        header, body = encode_vector(vec[lo:hi].contiguous(), compress)
        out.append((header, body))
        decoded.append(decode_vector(header, body))
    return out, torch.cat(decoded)


class StoreObjectError(ComposerPluginsError, RuntimeError):
    """An object the run cannot do without (run.json, a manifest, every state) is not a DiLoCo data object."""


class ForeignObjectError(CorruptObjectError):
    """An object in the run directory belongs to another run (its run id differs, or it carries none): refused
    like a damaged one (a state: an older one is tried; a pseudo-gradient: left out; a manifest, a mean or
    ``init``, which cannot be replaced: the replica stops, naming it)."""

    def __init__(self, where: str, theirs: object, mine: object) -> None:
        super().__init__(
            f"{where} belongs to run {theirs!r}, not to this run ({mine!r}) (diloco.store): refused (nothing in it "
            "was used). HINT: give this run a fresh prefix (diloco.store), or continue that run with its own "
            "--run-id (diloco.run_id) and settings."
        )


class RoundStore:
    """The run directory's objects, read and written as data with checksums (see the module docstring)."""

    def __init__(self, store: ObjectStore, run_id: str | None = None) -> None:
        self.store = store
        #: carried by every object written here; an object read here with another is refused
        self.run_id = run_id
        # pseudo-gradient indexes read intact, by (round, name): each is created once (If-None-Match), and both the
        # close of a round and the making of its mean need them, so each is read from the store once
        self._indexes: dict[tuple[int, str], dict[str, Any]] = {}

    @staticmethod
    def round_dir(r: int) -> str:
        return f"rounds/{r:08d}"

    def _where(self, key: str) -> str:
        return f"{self.store.where}/{key}"

    def _ours(self, key: str, header: dict[str, Any]) -> None:
        """Refuse (:class:`ForeignObjectError`) an object whose run id is not this run's."""
        if header.get("run") != self.run_id:
            raise ForeignObjectError(self._where(key), header.get("run"), self.run_id)

    # -- pseudo-gradients (sliced) and the round's aggregate ---------------------------
    def put_grad(self, r: int, index: int, restart: int, slices: list[tuple[dict[str, Any], bytes]]) -> tuple[str, int]:
        """Create this replica's pseudo-gradient of round ``r`` from its encoded slices
        (:func:`encode_slices`): ``(name, bytes)``.

        Each slice is its own object ``<name>.s<j>``; the index ``<name>`` (slice bounds and checksums) is
        created last, so a listed index always has its slices. The name is ``grad-<index>-<k>`` with the first
        ``k >= restart`` not taken (an earlier life of this replica, or of an earlier launch, may hold a smaller one).
        """
        d = self.round_dir(r)
        for k in range(restart, restart + _GRAD_TRIES):
            name = f"grad-{index}-{k}"
            # no HEAD first: a name taken by an earlier life has its slices, so the first create fails (a store
            # round trip less per round)
            nbytes, entries, lo = 0, [], 0
            for j, (h, body) in enumerate(slices):
                data = pack({**h, "kind": "grad-slice", "round": r, "replica": index, "slice": j}, body)
                if not self.store.put(f"{d}/{name}.s{j:03d}", data, create=True):
                    break  # an earlier life's orphan slices: take the next name
                hi = lo + int(h["numel"])
                entries.append([lo, hi, hashlib.sha256(data).hexdigest()])
                nbytes, lo = nbytes + len(data), hi
            else:
                idx = pack(
                    {
                        "kind": "grad",
                        "run": self.run_id,
                        "round": r,
                        "replica": index,
                        "restart": k,
                        "numel": lo,
                        "codec": slices[0][0]["codec"] if slices else "none",
                        "slices": entries,
                    },
                    b"",
                )
                if self.store.put(f"{d}/{name}", idx, create=True):
                    return name, nbytes + len(idx)
        last = restart + _GRAD_TRIES - 1
        raise StoreObjectError(
            f"{self._where(self.round_dir(r))}: grad-{index}-{restart}..{last} are all taken. "
            "HINT: the run directory is damaged; resume from a fresh prefix."
        )

    def grads_present(self, r: int) -> dict[int, list[str]]:
        """``{replica: [names, newest first]}`` of the pseudo-gradients written for round ``r``."""
        seen: dict[int, list[tuple[int, str]]] = {}
        for key in self.store.list(self.round_dir(r)):
            m = _GRAD.search(key)
            if m:
                seen.setdefault(int(m.group(1)), []).append((int(m.group(2)), key.rsplit("/", 1)[1]))
        return {i: [n for _, n in sorted(v, reverse=True)] for i, v in seen.items()}

    def _refuse(self, r: int, key: str, e: Exception) -> None:
        msg = str(e) if str(e).startswith(self.store.where) else f"{self._where(key)}: {one_line(e)}"
        log.warning("round %d: %s; refused (nothing in it was run), treated as missing", r, msg)

    def read_grad_index(self, r: int, name: str, numel: int | None = None) -> dict[str, Any] | None:
        """The index of pseudo-gradient ``name`` (a few hundred bytes); ``None`` (logged) if missing, not a
        DiLoCo data object or of another size."""
        key = f"{self.round_dir(r)}/{name}"
        cached = self._indexes.get((r, name))
        if cached is not None:
            return cached if numel is None or cached["numel"] == numel else None
        try:
            data = self.store.get(key)
            if data is None:
                return None
            header, _ = unpack(data, self._where(key))
            self._ours(key, header)
            entries = header.get("slices")
            if header.get("kind") != "grad" or not isinstance(entries, list) or not entries:
                raise CorruptObjectError(
                    f"{self._where(key)}: not a pseudo-gradient index (kind {header.get('kind')!r})"
                )
            lo = 0
            for e in entries:
                if not (
                    isinstance(e, list)
                    and len(e) == 3
                    and e[0] == lo
                    and isinstance(e[1], int)
                    and e[1] >= lo
                    and isinstance(e[2], str)
                ):
                    raise CorruptObjectError(f"{self._where(key)}: malformed slice table")
                lo = e[1]
            if lo != header.get("numel"):
                raise CorruptObjectError(f"{self._where(key)}: slices cover {lo} of {header.get('numel')} values")
        except (CorruptObjectError, ValueError, KeyError, TypeError) as e:
            self._refuse(r, key, e)
            return None
        if numel is not None and header["numel"] != numel:
            log.warning(
                "round %d: %s has %d values, the model %d; treated as missing",
                r,
                self._where(key),
                header["numel"],
                numel,
            )
            return None
        for old in [k for k in list(self._indexes) if k[0] < r - 2]:  # only the rounds in flight are read again
            self._indexes.pop(old, None)
        self._indexes[(r, name)] = header
        return header

    def read_grad_slice(self, r: int, name: str, index: dict[str, Any], j: int) -> torch.Tensor | None:
        """Slice ``j`` of pseudo-gradient ``name`` (its ``index``); ``None`` (logged) if missing, not the slice its
        index names (checksum), or not finite."""
        key = f"{self.round_dir(r)}/{name}.s{j:03d}"
        lo, hi, digest = index["slices"][j]
        try:
            data = self.store.get(key)
            if data is None:
                log.warning("round %d: %s is missing", r, self._where(key))
                return None
            if hashlib.sha256(data).hexdigest() != digest:
                raise CorruptObjectError(f"{self._where(key)}: not the slice its index {name} names (checksum)")
            header, body = unpack(data, self._where(key))
            if header.get("kind") != "grad-slice":
                raise CorruptObjectError(f"{self._where(key)}: not a pseudo-gradient slice")
            vec = decode_vector(header, body)
            if vec.numel() != hi - lo:
                raise CorruptObjectError(f"{self._where(key)}: {vec.numel()} values for {hi - lo}")
        except (CorruptObjectError, ValueError, KeyError, TypeError) as e:
            self._refuse(r, key, e)
            return None
        if not bool(torch.isfinite(vec).all()):
            log.warning("round %d: %s holds non-finite values; left out", r, self._where(key))
            return None
        return vec

    def read_grad(self, r: int, name: str, numel: int | None = None) -> torch.Tensor | None:
        """The whole decoded pseudo-gradient ``name`` of round ``r``; ``None`` (logged) if any part is missing,
        not a data object, of another size or not finite (that replica is left out)."""
        index = self.read_grad_index(r, name, numel)
        if index is None:
            return None
        parts = [self.read_grad_slice(r, name, index, j) for j in range(len(index["slices"]))]
        return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]

    def put_mean(self, r: int, j: int, vec: torch.Tensor, compress: str, count: int) -> tuple[torch.Tensor, bool]:
        """Create slice ``j`` of round ``r``'s mean pseudo-gradient (encoded with ``compress``) unless it exists:
        ``(the stored values, created)``. Whoever writes it, everyone applies the stored bits."""
        header, body = encode_vector(vec, compress)
        key = f"{self.round_dir(r)}/mean-{j:03d}"
        if self.store.put(
            key,
            pack({**header, "kind": "mean", "run": self.run_id, "round": r, "slice": j, "count": count}, body),
            create=True,
        ):
            return decode_vector(header, body), True
        stored = self.get_mean(r, j, vec.numel())
        if stored is None:  # pragma: no cover - a store that lost an object it said exists
            raise StoreObjectError(f"{self._where(key)} exists but cannot be read")
        return stored, False

    def get_mean(self, r: int, j: int, numel: int) -> torch.Tensor | None:
        """Slice ``j`` of round ``r``'s stored mean; ``None`` if not written yet; :class:`StoreObjectError` if it
        is not intact data (it was created once and cannot be replaced)."""
        key = f"{self.round_dir(r)}/mean-{j:03d}"
        data = self.store.get(key)
        if data is None:
            return None
        try:
            header, body = unpack(data, self._where(key))
            self._ours(key, header)
            if header.get("kind") != "mean" or header.get("round") != r or header.get("slice") != j:
                raise CorruptObjectError(f"{self._where(key)}: not slice {j} of round {r}'s mean")
            vec = decode_vector(header, body)
            if vec.numel() != numel or not bool(torch.isfinite(vec).all()):
                raise CorruptObjectError(f"{self._where(key)}: {vec.numel()} values for {numel}, or not finite")
        except (CorruptObjectError, ValueError, KeyError, TypeError) as e:
            msg = str(e) if str(e).startswith(self.store.where) else f"{self._where(key)}: {one_line(e)}"
            raise StoreObjectError(
                f"{msg}: refused (nothing in it was run); round {r}'s aggregate cannot be "
                "replaced. HINT: resume the run from a copy of the prefix without "
                f"rounds/{r:08d} and later."
            ) from e
        return vec

    # -- the manifest -----------------------------------------------------------------
    def manifest(self, r: int) -> dict[str, Any] | None:
        key = f"{self.round_dir(r)}/manifest.json"
        data = self.store.get(key)
        if data is None:
            return None
        try:
            header, body = unpack(data, self._where(key))
            self._ours(key, header)
            m = json.loads(body)
            ok = (
                header.get("kind") == "manifest"
                and isinstance(m, dict)
                and m.get("round") == r
                and isinstance(m.get("participants"), list)
                and isinstance(m.get("grads"), dict)
                and isinstance(m.get("slices"), int)
                and m["slices"] >= 1
                and sorted(int(i) for i in m["grads"]) == m["participants"]
                and all(
                    isinstance(n, str) and _GRAD.fullmatch(n) and n.split("-")[1] == i for i, n in m["grads"].items()
                )
            )
        except (CorruptObjectError, ValueError, TypeError) as e:
            msg = str(e) if str(e).startswith(self.store.where) else f"{self._where(key)}: {one_line(e)}"
            raise StoreObjectError(
                f"{msg}: round {r}'s manifest is not a DiLoCo data object and cannot be replaced "
                "(it was created once). HINT: resume the run from a copy of the prefix without "
                f"rounds/{r:08d} and later."
            ) from e
        if not ok:
            raise StoreObjectError(
                f"{self._where(key)}: not a manifest of round {r}. HINT: resume the run from a "
                f"copy of the prefix without rounds/{r:08d} and later."
            )
        return m

    def close_round(self, r: int, grads: dict[int, str], closer: int, slices: int = 1) -> tuple[dict[str, Any], bool]:
        """Create round ``r``'s manifest naming ``grads`` unless one exists; ``(manifest, created)``."""
        m = {
            "round": r,
            "run": self.run_id,
            "participants": sorted(grads),
            "grads": {str(i): n for i, n in sorted(grads.items())},
            "slices": slices,
            "closed_by": closer,
            "time": time.time(),
        }
        key = f"{self.round_dir(r)}/manifest.json"
        if self.store.put(key, pack({"kind": "manifest", "run": self.run_id}, json.dumps(m).encode()), create=True):
            return m, True
        existing = self.manifest(r)
        if existing is None:  # pragma: no cover - a store that lost an object it said exists
            raise StoreObjectError(f"{self._where(key)} exists but cannot be read")
        # our own create, whose answer was lost (a dropped connection) and whose retry found it there
        return existing, existing == m

    # -- states -----------------------------------------------------------------------
    def put_state(self, key: str, state: dict[str, Any], create: bool = True) -> int:
        """Write ``state`` (nested tensors and numbers) as data under ``key``; bytes written (0: it existed)."""
        kind = key.split("/")[0]
        tree, body = encode_tree(state, f"{kind}")
        data = pack({"kind": kind, "run": self.run_id, "tree": tree}, body)
        return len(data) if self.store.put(key, data, create=create) else 0

    def get_state(self, key: str) -> dict[str, Any] | None:
        """The state under ``key``; ``None`` if absent; :class:`CorruptObjectError` (naming it) if not intact data."""
        data = self.store.get(key)
        if data is None:
            return None
        header, body = unpack(data, self._where(key))
        kind = key.split("/")[0]
        self._ours(key, header)
        if header.get("kind") != kind or "tree" not in header:
            raise CorruptObjectError(f"{self._where(key)}: not a DiLoCo {kind} object (kind {header.get('kind')!r})")
        state = decode_tree(header["tree"], body, self._where(key))
        if not isinstance(state, dict):
            raise CorruptObjectError(f"{self._where(key)}: not a state mapping")
        return state

    def state_rounds(self) -> list[int]:
        """Rounds with a ``state/<r>`` object, newest first."""
        return sorted(
            (int(k.rsplit("/", 1)[1]) for k in self.store.list("state") if k.rsplit("/", 1)[1].isdigit()), reverse=True
        )

    def latest_state_round(self) -> int | None:
        rounds = self.state_rounds()
        return rounds[0] if rounds else None

    def newest_valid_state(self, at_least: int = 0) -> tuple[int, dict[str, Any]] | None:
        """``(r, state)`` of the newest ``state/<r>`` (``r >= at_least``) that is intact data; refused ones logged."""
        for k in self.state_rounds():
            if k < at_least:
                break
            try:
                state = self.get_state(f"state/{k:08d}")
            except CorruptObjectError as e:
                log.error("%s; refused (nothing in it was run), trying an older state", e)
                continue
            if state is not None:
                return k, state
        return None

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def collect_garbage(self, newest: int, keep_rounds: int) -> int:
        """Delete states older than the newest ``keep_rounds`` and the pseudo-gradients of rounds those can no
        longer rebuild (manifests stay)."""
        states = [k for k in self.state_rounds() if k <= newest]
        if len(states) <= keep_rounds:
            return 0
        oldest_kept = states[keep_rounds - 1]
        n = 0
        for key in self.store.list("state"):
            name = key.rsplit("/", 1)[1]
            if name[:8].isdigit() and int(name[:8]) < oldest_kept:
                self.store.delete(key)
                n += 1
        for key in self.store.list("rounds"):
            parts = key.split("/")
            # pseudo-gradients only: a manifest (a few hundred bytes) stays, so a straggler still in that round
            # finds it closed and never closes it a second time
            if (
                len(parts) >= 2
                and parts[-2].isdigit()
                and int(parts[-2]) <= oldest_kept
                and ("grad-" in parts[-1] or "mean-" in parts[-1])
            ):
                self.store.delete(key)
                n += 1
        return n


class ObjectStoreDiLoCoCallback(DiLoCoCallbackBase):
    """One DiLoCo replica whose outer sync goes through an object store (see the module docstring).

    Add it to a single-optimizer Lightning run in every replica process, as :class:`DiLoCoCallback`;
    outside Lightning call :meth:`attach` with the model and the inner optimizer.
    """

    transport = "object_store"

    def __init__(self, config: DiLoCoConfig | None = None, replica: ReplicaInfo | None = None) -> None:
        super().__init__(config or DiLoCoConfig(transport="object_store"), replica)
        self.store: ObjectStore | None = None
        self.rounds: RoundStore | None = None
        self.fragments: list[nn.Module] = []
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        self.params: list[nn.Parameter] = []
        self.global_params: list[torch.Tensor] = []
        self.round = 0  # the next round to sync; == outer steps applied so far
        self._done = False
        self.bytes_pseudograd = 0
        self.run_id: str | None = None
        self._residual: torch.Tensor | None = None  # a lossy codec's error feedback (host, fp32)
        #: the same for the mean slices this replica wrote: (slice, values) -> what the stored mean left out
        self._mean_residual: dict[tuple[int, int], torch.Tensor] = {}
        self._counted = (0, 0, 0)  # the store's byte and retry counters at the last sync record
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._background: concurrent.futures.ThreadPoolExecutor | None = None
        self._overlapped: tuple[Any, ...] | None = None  # overlap: 1 -- (round, future, snapshot, result, seconds)

    # -- public state ---------------------------------------------------------------------
    @property
    def outer_step(self) -> int:
        return self.round

    @property
    def bytes_allreduced(self) -> int:
        """Bytes of pseudo-gradients this replica wrote (the torchft path's counter of the same name)."""
        return self.bytes_pseudograd

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._background is not None:
            if self._overlapped is not None:
                try:  # an exception ended the run: let the round's writes finish, report nothing more
                    self._overlapped[1].result()
                except Exception as e:  # the run is already failing
                    log.warning("DiLoCo: the background sync of round %d failed: %s", self._overlapped[0], one_line(e))
                self._overlapped = None
            self._background.shutdown(wait=True)
            self._background = None
        if self._writer is not None:
            try:
                self._flush_writes()
            finally:
                self._writer.shutdown(wait=True)
                self._writer = None

    # -- wiring ---------------------------------------------------------------------------
    def attach(self, module: nn.Module, inner_optimizer: torch.optim.Optimizer) -> ObjectStoreDiLoCoCallback:
        """Open the store, check the run directory, and take the newest global state if the run has one."""
        if self.store is not None:
            return self
        c = self.config
        url = c.store or self.replica.store or os.environ.get(_env.ENV_STORE)
        get_transport(self.transport).require(c, url)
        assert url is not None
        self.run_id = c.run_id or self.replica.run_id
        if not self.run_id:
            raise ConfigError(
                f"this replica does not know which run on {redact_url(url)} it belongs to (no diloco.run_id and no "
                f"${_env.ENV_RUN_ID}). HINT: `composer-plugins diloco` sets it; a replica started by hand must name "
                "the run: -S diloco.run_id=<id> (see run.json in the store for the id of a run to join).",
                key="diloco.run_id",
            )
        self._module, self._inner = module, inner_optimizer
        self.fragments = split_fragments(module, 1)
        self.params = list(self.fragments[0].parameters())
        # the outer optimizer steps the global weights themselves (leaf tensors that need no autograd), so an
        # outer step in the background (``overlap: 1``) never touches the weights the inner steps train
        self.global_params = [nn.Parameter(p.detach().clone(), requires_grad=False) for p in self.params]
        self.outer_optimizers = [build_outer_optimizer(c, self.global_params)]
        self.store = ObjectStore(url, retry_s=c.store_retry_s, request_timeout_s=c.request_timeout_s)
        self.rounds = RoundStore(self.store, self.run_id)
        self._probe_conditional_create()
        self._check_run()
        found = self.rounds.newest_valid_state()
        if found is not None:
            self._apply_state(*found)
            log.info("DiLoCo: replica %d starts from %s/state/%08d", self.replica.index, self.store.where, found[0])
        self._replay_closed_rounds()
        if self._target is not None and self.round >= self._target:
            self._done = True
        self._counted = (self.store.bytes_written, self.store.bytes_read, self.store.retries)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        log.info(
            "DiLoCo replica %s (%d/%d) on store %s (run %s): H=%d, compress=%s, %d params",
            self.replica.replica_id,
            self.replica.index,
            self.replica.num_replicas,
            self.store.where,
            self.run_id,
            c.sync_every,
            c.compress,
            sum(p.numel() for p in self.params),
        )
        return self

    def _probe_conditional_create(self) -> None:
        """Refuse a store that does not honour If-None-Match: the round manifest depends on it."""
        assert self.store is not None
        key = f"probe/{self.replica.index}-{os.urandom(6).hex()}"
        first = self.store.put(key, b"probe", create=True)
        second = self.store.put(key, b"probe", create=True)
        self.store.delete(key)
        if not first or second:
            raise ConfigError(
                f"{self.store.where} does not honour conditional creates (If-None-Match: *): two "
                "creates of one key both succeeded. DiLoCo's round manifest needs them. HINT: use S3, "
                "GCS, Azure, R2 or a file:// store, or a server version that supports them.",
                key="diloco.store",
            )

    def _run_identity(self) -> dict[str, Any]:
        """What ``run.json`` pins: who the run is and every setting its replicas must share (JSON values)."""
        assert self._inner is not None
        shapes = [list(p.shape) for p in self.params]
        mine = {
            "run_id": self.run_id,
            "num_replicas": self.replica.num_replicas,
            "sync_every": self.config.sync_every,
            "compress": self.config.compress,
            "param_shapes": shapes,
            "outer_optimizer": optimizer_settings(self.outer_optimizers[0]),
            "inner_optimizer": optimizer_settings(self._inner),
        }
        return json.loads(json.dumps(mine))

    def _check_run(self) -> None:
        """Claim the run directory (``run.json``) or check that it holds this run with this replica's settings;
        refuse another run's, and a prefix holding another run's objects whose ``run.json`` is gone."""
        assert self.store is not None
        mine = self._run_identity()
        if self.store.put("run.json", pack({"kind": "run"}, json.dumps(mine).encode()), create=True):
            self._refuse_leftovers()
        data = self.store.get("run.json")
        try:
            header, body = unpack(data or b"", f"{self.store.where}/run.json")
            theirs = json.loads(body)
            if header.get("kind") != "run" or not isinstance(theirs, dict):
                raise CorruptObjectError(f"{self.store.where}/run.json: not a run description")
        except (CorruptObjectError, ValueError) as e:
            raise ConfigError(
                f"{self.store.where}/run.json: {one_line(e)}: the run directory is damaged (refused; "
                "nothing in it was run). HINT: point diloco.store at a fresh prefix.",
                key="diloco.store",
            ) from e
        diff = [k for k in mine if theirs.get(k) != mine[k]]
        if not diff:
            return
        if "run_id" in diff or "param_shapes" in diff:
            what = ", ".join(
                f"{k}: {theirs.get(k)!r} there, {mine[k]!r} here"
                for k in diff
                if k in ("run_id", "num_replicas", "sync_every", "compress")
            )
            if "param_shapes" in diff:
                what += ("; " if what else "") + "another model (parameter shapes differ)"
            resume = (
                f" To continue that run, pass --run-id {theirs.get('run_id')} (diloco.run_id) with its settings."
                if diff == ["run_id"]
                else ""
            )
            raise ConfigError(
                f"{self.store.where} holds another run ({what}). HINT: give this run a fresh prefix, e.g. "
                f"diloco.store={self.store.where.rsplit('/', 1)[0]}/<new-run>, or delete the old one.{resume}",
                key="diloco.store",
            )
        settings = []
        for k in diff:
            a, b = theirs.get(k), mine[k]
            if isinstance(a, dict) and isinstance(b, dict):
                settings += [
                    f"{k}.{f} is {a.get(f, '(unset)')!r} in the run, {b.get(f, '(unset)')!r} here"
                    for f in sorted(set(a) | set(b))
                    if a.get(f) != b.get(f)
                ]
            else:
                settings.append(f"{k} is {a!r} in the run, {b!r} here")
        fix = {
            "sync_every": "diloco.sync_every",
            "compress": "diloco.compress",
            "num_replicas": "--replicas / --total-replicas",
            "outer_optimizer": "diloco.outer_lr, diloco.outer_momentum, diloco.outer_nesterov "
            "or diloco.outer_optimizer",
            "inner_optimizer": "the training config's optimizer (its learning rate "
            "and hyper-parameters; a replica joining before round 0 would otherwise take the run's)",
        }
        raise ConfigError(
            f"this replica's settings differ from those of run {theirs.get('run_id')!r} "
            f"({self.store.where}/run.json): {'; '.join(settings)}. Every replica of a run must share them (the "
            f"outer step and the pseudo-gradients are only the same computation with the same settings). HINT: set "
            f"{'; '.join(fix[k] for k in diff if k in fix)} to the run's values, or start another run on a fresh "
            "prefix.",
            key="diloco.store",
        )

    def _refuse_leftovers(self) -> None:
        """This replica just created ``run.json``: refuse (and take it back) if the prefix already holds another
        run's objects (a lifecycle rule that deleted the oldest object first leaves states without their run).
        Each kind's newest object is looked at here; every object read later is checked as it is read."""
        assert self.store is not None
        for sub in ("init", "state", "rounds"):
            keys = (["init"] if self.store.exists("init") else []) if sub == "init" else self.store.list(sub)
            # the objects that name their run (a pseudo-gradient's slices and a large object's blob do not)
            keys = [k for k in keys if not _UNNAMED.search(k)]
            if keys:
                key = sorted(keys)[-1]
                try:
                    data = self.store.get(key)
                    theirs = unpack(data, f"{self.store.where}/{key}")[0].get("run") if data else None
                except (CorruptObjectError, ValueError):
                    theirs = "(unreadable)"
                if theirs == self.run_id:  # this run's own objects (its run.json was lost): it continues
                    continue
                self.store.delete("run.json")
                raise ForeignObjectError(
                    f"{self.store.where}/{key} (the prefix has no run.json: this run was about to claim it)",
                    theirs,
                    self.run_id,
                )

    # -- state ----------------------------------------------------------------------------
    def _global_state(self) -> dict[str, Any]:
        """This round's global state on the host (copies: the background writer encodes them later)."""
        return {
            "round": self.round,
            "global_params": [to_host(g).clone() for g in self.global_params],
            "outer_optimizers": [_host_tree(o.state_dict()) for o in self.outer_optimizers],
        }

    def _apply_state(self, k: int, state: dict[str, Any]) -> None:
        try:
            saved_params = list(state["global_params"])
            with torch.no_grad():
                for g, p, saved in zip(self.global_params, self.params, saved_params, strict=True):
                    if saved.shape != g.shape:
                        raise ValueError(f"a parameter of shape {list(saved.shape)} for {list(g.shape)}")
                    g.copy_(saved)
                    p.copy_(saved)
            for opt, sd in zip(self.outer_optimizers, state["outer_optimizers"], strict=True):
                opt.load_state_dict(sd)
        except (KeyError, TypeError, ValueError) as e:
            raise StoreObjectError(
                f"{self.store.where if self.store else ''}/state/{k:08d} does not fit this model: {e}"
            ) from e
        self.round = k + 1
        self.heal_count += 1
        self._healed_since_sync = True

    def _replica_state(self) -> dict[str, Any]:
        assert self._module is not None and self._inner is not None
        scheds = [cfg.scheduler.state_dict() for cfg in self._trainer.lr_scheduler_configs] if self._trainer else []
        return _host_tree(
            {
                "model": self._module.state_dict(),
                "inner_optimizer": self._inner.state_dict(),
                "lr_schedulers": scheds,
                "global_params": list(self.global_params),
            }
        )

    def _init_sync(self) -> None:
        """Round 0 with ``init_sync``: every replica starts from the run's ``init`` (as torchft heals from one).

        Replica 0 creates ``init`` from its state (a conditional create: a restarted replica 0, or a relaunch,
        finds it there and takes it like the others). The others wait for it up to
        ``diloco.barrier_timeout_s`` and fail with a located error after that; nobody trains from its own
        weights.
        """
        assert self.rounds is not None and self._module is not None and self._inner is not None
        if self.replica.index == 0 and self.rounds.put_state("init", self._replica_state(), create=True):
            return
        deadline = time.monotonic() + self.config.barrier_timeout_s
        delay = self.config.poll_s
        while True:
            try:
                state = self.rounds.get_state("init")
            except CorruptObjectError as e:
                raise StoreObjectError(
                    f"{e}; refused (nothing in it was run). The run's starting point is damaged. "
                    "HINT: start the run again on a fresh prefix."
                ) from e
            if state is not None:
                break
            if time.monotonic() > deadline:
                raise ComposerPluginsError(
                    f"replica {self.replica.index}: no {self.rounds.store.where}/init within "
                    f"diloco.barrier_timeout_s={self.config.barrier_timeout_s:.0f}s (replica 0 writes it at its first "
                    "sync). HINT: start replica 0, or raise diloco.barrier_timeout_s."
                )
            time.sleep(delay)
            delay = min(delay * 1.5, self.config.poll_max_s)
        try:
            self._module.load_state_dict(state["model"])
            self._inner.load_state_dict(state["inner_optimizer"])
            if self._trainer is not None:
                for cfg, sd in zip(self._trainer.lr_scheduler_configs, state["lr_schedulers"], strict=False):
                    cfg.scheduler.load_state_dict(sd)
            with torch.no_grad():
                for g, saved in zip(self.global_params, state["global_params"], strict=True):
                    g.copy_(saved)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise StoreObjectError(f"{self.rounds.store.where}/init does not fit this model: {e}") from e
        self.heal_count += 1
        self._healed_since_sync = True

    # -- the round ------------------------------------------------------------------------
    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._inner_steps += 1
        if self._done:  # restarted after the run's last round: hold the final global weights
            with torch.no_grad():
                for p, g in zip(self.params, self.global_params, strict=True):
                    p.copy_(g)
            self._stop = True
            if self._trainer is not None:
                self._trainer.should_stop = True
            return
        self._since_sync += 1
        if self._since_sync < self.config.sync_every:
            return
        self._since_sync = 0
        self._sync()

    def _sync(self) -> None:
        assert self.rounds is not None and self.store is not None
        self._raise_write_error()
        t0 = time.perf_counter()
        if self._overlapped is not None:  # overlap: 1 -- the previous round's sync, applied one round late
            self._finish_overlapped()
        r = self.round
        last = self._target is not None and r + 1 >= self._target
        if self.config.overlap and not last:  # the background job looks for the round's manifest itself
            self._launch_overlapped(r, t0)
            return
        manifest = self.rounds.manifest(r)
        if manifest is not None:  # closed without this replica (late): catch up in the foreground
            self._settle(r, manifest, False, None, None, None, t0)
            return
        mine_name, mine, err = self._publish(r)
        manifest, created = self._close(r, self.replica.index, mine_name)
        self._settle(r, manifest, created, mine_name, mine, err, t0)

    def _publish(self, r: int, params: list[torch.Tensor] | None = None) -> tuple[str | None, torch.Tensor, float]:
        """Write this replica's pseudo-gradient of round ``r`` from ``params`` (default: the model's; ``init_sync``
        first at round 0): ``(name or None when not finite, the values the others read, compression error)``."""
        assert self.rounds is not None
        c = self.config
        if params is None and r == 0 and c.init_sync and self.replica.num_replicas > 1:
            self._init_sync()
        with torch.no_grad():
            pairs = zip(self.global_params, params if params is not None else self.params, strict=True)
            pseudo = torch.cat([to_host(g - p.detach()).reshape(-1) for g, p in pairs])
        if self._residual is not None:  # error feedback: what the last round's rounding left out
            pseudo = pseudo + self._residual
        parts, mine = encode_slices(pseudo, c.compress, self.replica.num_replicas)
        err = float((mine - pseudo).norm() / pseudo.norm().clamp_min(1e-30)) if c.compress != "none" else 0.0
        if get_codec(c.compress).error_feedback:
            self._residual = pseudo - mine
        if not bool(torch.isfinite(mine).all()):
            log.error("DiLoCo round %d: this replica's pseudo-gradient is not finite; not published (left out)", r)
            return None, mine, err
        name, nbytes = self.rounds.put_grad(r, self.replica.index, self.replica.restart, parts)
        self.bytes_pseudograd += nbytes
        return name, mine, err

    def _settle(
        self,
        r: int,
        manifest: dict[str, Any],
        created: bool,
        mine_name: str | None,
        mine: torch.Tensor | None,
        err: float | None,
        t0: float,
    ) -> None:
        """Apply round ``r`` in the foreground (or catch up when left out of it) and record it."""
        committed = mine_name is not None and manifest["grads"].get(str(self.replica.index)) == mine_name
        if committed and self._apply_round(r, manifest, mine, mix_local=True):
            if created and self._state_due(r):
                self._write_state_async()
                if self._target is not None and self.round >= self._target:
                    self._flush_writes()  # the last round: no inner steps left to overlap, and it is counted here
        else:
            committed = False
            self._catch_up(r, manifest)
        self._record_round(r, committed, len(manifest["participants"]), err, time.perf_counter() - t0)

    def _record_round(
        self,
        r: int,
        committed: bool,
        participants: int,
        err: float | None,
        seconds: float,
        *,
        digest: tuple[str, float] | None = None,
        background: dict[str, float] | None = None,
    ) -> None:
        assert self.store is not None
        # since the last record: the state written in the background after a sync counts in the next one
        w0, r0, n0 = self._counted
        now = (self.store.bytes_written, self.store.bytes_read, self.store.retries)
        self._counted = now
        self._record(
            r, committed, participants, err, seconds, now[0] - w0, now[1] - r0, now[2] - n0, digest, background
        )
        if self._trainer is not None and self._stop:
            self._trainer.should_stop = True

    # -- overlap: 1 (the outer sync of round r runs while round r+1's inner steps do) ----------------------
    def _launch_overlapped(self, r: int, t0: float) -> None:
        """Snapshot the model's weights, then publish round ``r``'s pseudo-gradient, close the round and take its
        outer step on the global weights in a background thread; the model's weights are left to the inner steps
        of round ``r + 1`` (see :meth:`_finish_overlapped`). ``init_sync`` (round 0) stays in the foreground.

        The training thread only copies the weights (the snapshot, one ``clone`` per parameter); every store
        request (the manifest check included), the codec, the checksums, the mean, the outer step and the sync
        log's parameter hash run in the background thread (torch's kernels, ``hashlib`` and ``zlib`` release the
        GIL on large buffers; the waits sleep with backoff, ``poll_s`` to ``poll_max_s``)."""
        me = self.replica.index
        c = self.config
        if r == 0 and c.init_sync and self.replica.num_replicas > 1:
            self._init_sync()
        snapshot = [p.detach().clone() for p in self.params]
        result: dict[str, Any] = {}
        want_hash = bool((c.sync_log or self.replica.sync_log) and c.log_param_hash)

        def job() -> tuple[dict[str, Any], bool]:
            assert self.rounds is not None
            closed = self.rounds.manifest(r)
            if closed is not None:  # closed without this replica (late): caught up at the next sync
                return closed, False
            times = result["background_s"] = {}
            t, cpu = time.perf_counter(), time.thread_time()
            mine_name, mine, result["err"] = self._publish(r, snapshot)
            times["publish"], t = time.perf_counter() - t, time.perf_counter()
            manifest, created = self._close(r, me, mine_name)
            times["close"], t = time.perf_counter() - t, time.perf_counter()
            committed = mine_name is not None and manifest["grads"].get(str(me)) == mine_name
            if not (committed and self._apply_round(r, manifest, mine, mix_local=False, live=False)):
                return manifest, False
            if want_hash:  # the global weights this round produced (untouched until the next job)
                result["digest"] = param_digest(self.global_params)
            times["mean_and_outer_step"], t = time.perf_counter() - t, time.perf_counter()
            if created and self._state_due(r):
                self.rounds.put_state(f"state/{r:08d}", self._global_state(), create=True)
                if self.config.keep_rounds:
                    self.rounds.collect_garbage(r, self.config.keep_rounds)
                times["state"] = time.perf_counter() - t
            times["cpu"] = time.thread_time() - cpu  # this thread's CPU time for the round (the rest is waiting)
            return manifest, True

        if self._background is None:
            self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-overlap")
        future = self._background.submit(job)
        self._overlapped = (r, future, snapshot, result, time.perf_counter() - t0)

    @torch.no_grad()
    def _finish_overlapped(self) -> None:
        """Wait for the background sync of round ``r`` and apply it one round late: the model's weights become
        the new global weights plus the inner steps taken since round ``r``'s snapshot (a delayed outer update,
        as Streaming DiLoCo's overlap); a replica left out of round ``r`` catches up (dropping those steps)."""
        assert self._overlapped is not None
        r, future, snapshot, result, launch_s = self._overlapped
        self._overlapped = None
        t0 = time.perf_counter()
        manifest, committed = future.result()
        err = result.get("err")
        if committed:
            for p, g, s in zip(self.params, self.global_params, snapshot, strict=True):
                p.add_(g - s)
        else:
            self._catch_up(r, manifest)
        self._record_round(
            r,
            committed,
            len(manifest["participants"]),
            err,
            launch_s + time.perf_counter() - t0,
            digest=result.get("digest") if committed else None,
            background=result.get("background_s"),
        )

    def _apply_round(
        self, r: int, manifest: dict[str, Any], own: torch.Tensor | None, *, mix_local: bool, live: bool = True
    ) -> bool:
        """Take round ``r``'s outer step with its stored mean pseudo-gradient (:meth:`_round_mean`) from the global
        state of round ``r - 1`` held here. ``False`` (nothing changed) when the mean cannot be had."""
        mean = self._round_mean(r, manifest, own)
        if mean is None:
            return False
        self._outer_step(mean, mix_local=mix_local, live=live)
        self.round = r + 1
        return True

    def _round_mean(self, r: int, manifest: dict[str, Any], own: torch.Tensor | None) -> torch.Tensor | None:
        """Round ``r``'s mean pseudo-gradient, as stored in ``rounds/<r>/mean-<j>`` (one object per slice).

        Slice ``j`` belongs to participant ``participants[j % P]``: it reads slice ``j`` of the others'
        pseudo-gradients (its own from ``own``, never from the store), sums them in index order, divides by
        their number, and creates ``mean-<j>`` with the run's codec. Everyone then applies the stored bits
        (identical whoever wrote them: a create happens once), so each replica reads about ``2 (N-1)/N``
        compressed pseudo-gradients per round whatever ``N``. A slice its owner has not written within
        ``round_timeout_s`` (or at once, for a round already closed: ``own`` is ``None``) is computed and
        created by whoever needs it. ``None`` when a round rebuilt later lacks a listed slice.
        """
        assert self.rounds is not None
        c, rs, me = self.config, self.rounds, self.replica.index
        parts = list(manifest["participants"])
        numel = sum(p.numel() for p in self.params)
        bounds = slice_bounds(numel, int(manifest["slices"]))
        indexes: dict[int, dict[str, Any] | None] = {}
        out: dict[int, torch.Tensor] = {}
        codec = get_codec(c.compress)

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
            # is added to the next mean of it this replica writes
            key = (j, hi - lo)
            carry = self._mean_residual.pop(key, None) if codec.error_feedback else None
            want = mean if carry is None else mean + carry
            stored, created = rs.put_mean(r, j, want, c.compress, count)
            if created and codec.error_feedback:
                self._mean_residual[key] = want - stored
            return stored

        if own is not None:
            for j in range(len(bounds)):
                if parts[j % len(parts)] == me:
                    got = make(j)
                    if got is None:
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
                        got = make(j)
                        if got is None:
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
        assert self.rounds is not None
        return any(k >= r for k in self.rounds.state_rounds())

    def _close(self, r: int, me: int, mine_name: str | None) -> tuple[dict[str, Any], bool]:
        """Wait for the others' pseudo-gradients (up to the deadline), then close the round or read its manifest.

        Only the pseudo-gradients' indexes are read here (a few hundred bytes each): the data is read slice by
        slice when the round's mean is made (:meth:`_round_mean`)."""
        assert self.rounds is not None
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
            if len(good) >= n or (good and time.monotonic() > deadline):
                missing = sorted(set(range(n)) - set(good))
                if missing:
                    log.warning("DiLoCo round %d: closing without replica(s) %s (missing, late or refused)", r, missing)
                return rs.close_round(r, good, me, slices=n)
            if not good and time.monotonic() > deadline + c.round_timeout_s:
                raise ComposerPluginsError(
                    f"round {r}: no readable pseudo-gradient in {rs.store.where}/{rs.round_dir(r)} within "
                    f"2 x diloco.round_timeout_s={c.round_timeout_s:.0f}s (this replica's own was not published: "
                    "not finite). HINT: see the log for the refused objects; lower the learning rate."
                )
            time.sleep(delay)
            delay = min(delay * 1.5, c.poll_max_s)

    @torch.no_grad()
    def _outer_step(self, avg: torch.Tensor, *, mix_local: bool = True, live: bool = True) -> None:
        """The outer step torchft's ``_StreamingDiLoCoFragment.perform_sync`` applies, on the averaged vector:
        the outer optimizer steps the global weights with it as their gradient; then (``live``) the model takes
        the global weights, mixed with its local ones by ``fragment_update_alpha`` (``mix_local``).

        ``mix_local=False`` (a replica rebuilding a round it was not part of) keeps the global weights only;
        ``live=False`` (the background sync of ``overlap: 1``) leaves the model's weights alone.
        """
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

    def _replay_closed_rounds(self) -> int:
        """Rebuild every round closed after the state held here from its manifest's pseudo-gradients (the same
        bits its participants computed), writing ``state/<r>`` where it is missing. Rounds replayed."""
        assert self.rounds is not None
        n = 0
        if self.round == 0 and (self.rounds.manifest(0) is None or not self._take_init_globals()):
            return 0
        while (m := self.rounds.manifest(self.round)) is not None:
            r = self.round
            if not self._apply_round(r, m, None, mix_local=False):
                break
            n += 1
            self.heal_count += 1
            self._healed_since_sync = True
            key = f"state/{r:08d}"
            if self._state_due(r) and not self.rounds.exists(key):
                self.rounds.put_state(key, self._global_state(), create=True)
                log.warning(
                    "DiLoCo: rebuilt %s/%s from round %d's manifest (its closer did not write it)",
                    self.rounds.store.where,
                    key,
                    r,
                )
        if n:
            log.info(
                "DiLoCo: replica %d replayed %d closed round(s); now at round %d", self.replica.index, n, self.round
            )
        return n

    def _take_init_globals(self) -> bool:
        """Before rebuilding round 0: the global weights round 0 started from (``init``'s, with ``init_sync``)."""
        assert self.rounds is not None
        if not (self.config.init_sync and self.replica.num_replicas > 1):
            return True
        try:
            init = self.rounds.get_state("init")
        except CorruptObjectError as e:
            raise StoreObjectError(f"{e}; refused (nothing in it was run)") from e
        if init is None:
            return False
        with torch.no_grad():
            for g, p, saved in zip(self.global_params, self.params, init["global_params"], strict=True):
                g.copy_(saved)
                p.copy_(saved)
        return True

    def _catch_up(self, r: int, manifest: dict[str, Any]) -> None:
        """Left out of round ``r``: drop the local steps, rebuild round ``r`` (and any closed since) from the
        manifests, or load a newer global state when a listed pseudo-gradient is gone."""
        assert self.rounds is not None
        log.warning("DiLoCo: left out of round %d (late); catching up", r)
        if (r > 0 or self._take_init_globals()) and self._apply_round(r, manifest, None, mix_local=False):
            self.heal_count += 1
            self._healed_since_sync = True
            self._replay_closed_rounds()
            return
        deadline = time.monotonic() + self.config.round_timeout_s
        while True:
            found = self.rounds.newest_valid_state(at_least=r)
            if found is not None:
                self._apply_state(*found)
                self._replay_closed_rounds()
                return
            if time.monotonic() > deadline:
                raise ComposerPluginsError(
                    f"round {r} closed without this replica, its pseudo-gradients are unreadable and no global state "
                    f"for it appeared in {self.rounds.store.where}/state within "
                    f"diloco.round_timeout_s={self.config.round_timeout_s:.0f}s"
                )
            time.sleep(self.config.poll_s)

    def _state_due(self, r: int) -> bool:
        """Whether round ``r``'s global state is written: every ``state_every`` rounds and at the last round (the
        rounds between are rebuilt from their manifests and pseudo-gradients)."""
        k = self.config.state_every
        return r % k == k - 1 or (self._target is not None and r + 1 >= self._target)

    # -- the state writer (off the critical path) ---------------------------------------------
    def _write_state_async(self) -> None:
        """Write ``state/<round-1>`` in the background (the next inner steps do not wait for it)."""
        assert self.rounds is not None
        r = self.round - 1
        state = self._global_state()
        rs, keep = self.rounds, self.config.keep_rounds

        def job() -> None:
            rs.put_state(f"state/{r:08d}", state, create=True)
            if keep:
                rs.collect_garbage(r, keep)

        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-state")
        self._pending.append(self._writer.submit(job))

    def _raise_write_error(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()

    def _flush_writes(self) -> None:
        for f in self._pending:
            f.result()
        self._pending = []

    def _record(
        self,
        r: int,
        committed: bool,
        participants: int,
        err: float | None,
        seconds: float,
        written: int,
        read: int,
        retries: int,
        digest: tuple[str, float] | None = None,
        background: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        c = self.config
        rec: dict[str, Any] = {
            "replica": self.replica.index,
            "replica_id": self.replica.replica_id,
            "restart": self.replica.restart,
            "outer_step": self.round,
            "inner_step": self._inner_steps,
            "committed": committed,
            "participants": participants,
            "fragment": 0,
            "healed": self._healed_since_sync,
            "bytes_allreduced": self.bytes_allreduced,
            "time": time.time(),
            "transport": self.transport,
            "round": r,
            "bytes_written": written,
            "bytes_read": read,
            "compress_error": err,
            "sync_seconds": seconds,
            "store_retries": retries,
        }
        if background is not None:  # overlap: 1 -- where the background sync's time went (publish, close, ...)
            rec["background_s"] = background
        self._healed_since_sync = False
        if self._target is not None and self.round >= self._target:
            self._stop = True
        if stop_file_says_stop(c.stop_file or self.replica.stop_file, self.round):
            self._stop = True
        rec["writes_checkpoint"] = False
        rec["stop"] = self._stop
        sync_log = c.sync_log or self.replica.sync_log
        if sync_log and c.log_param_hash:
            # the synced (trainable) weights: a frozen EMA hint teacher is per-replica local state
            # with overlap: 1 the model carries its own steps since the last snapshot: the global weights are synced
            if c.overlap and not self._stop:
                # the background job hashed them already (``digest``) unless this round was caught up here
                rec["param_hash"], rec["param_sum"] = digest or param_digest(self.global_params)
            else:
                synced = (p for p in self._module.parameters() if p.requires_grad)  # type: ignore[union-attr]
                rec["param_hash"], rec["param_sum"] = param_digest(synced)
            rec["fragment_hash"] = rec["param_hash"]
        self.history.append(rec)
        if sync_log:
            with open(sync_log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec


#: optimizer ``param_groups`` keys that choose an implementation, not the update (they may differ by device)
_IMPLEMENTATION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "initial_lr"})


def optimizer_settings(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What an optimizer computes, as JSON values: its class and each parameter group's hyper-parameters (the
    learning rate a scheduler started from, ``initial_lr``, where one is attached). Group ``g > 0``'s keys are
    prefixed ``group<g>.``."""
    out: dict[str, Any] = {"class": f"{type(opt).__module__}.{type(opt).__qualname__}"}
    for g, group in enumerate(opt.param_groups):
        prefix = f"group{g}." if g else ""
        for k, v in sorted(group.items()):
            if k in _IMPLEMENTATION_KEYS:
                continue
            if k == "lr" and "initial_lr" in group:
                v = group["initial_lr"]
            out[prefix + k] = _json_value(v)
    return out


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def _host_tree(obj: Any) -> Any:
    """``obj`` with every tensor copied to the host (a plain CPU tensor), for the data codec."""
    if isinstance(obj, torch.Tensor):
        t = to_host(obj)
        return t.clone() if t.data_ptr() == obj.data_ptr() else t
    if isinstance(obj, list):
        return [_host_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_host_tree(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _host_tree(v) for k, v in obj.items()}
    return obj
