"""The run directory's objects (pseudo-gradient slices and their indexes, manifests, means, states), read and
written as data with checksums; each carries its run id (see :mod:`composer_plugins.diloco.objstore`)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from composer_plugins.core.errors import ComposerPluginsError, one_line
from composer_plugins.diloco.codecs import CodecError, check_decoded
from composer_plugins.diloco.objstore.statehash import flatten, state_hash
from composer_plugins.diloco.store import (
    CorruptObjectError,
    ObjectStore,
    decode_tree,
    decode_vector,
    encode_tree,
    encode_vector,
    pack,
    unpack,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


_GRAD = re.compile(r"grad-(\d+)-(\d+)$")
_REFUSED = re.compile(r"refused-(\d+)$")
#: objects that carry no run id of their own: a pseudo-gradient's slices (its index's checksums name them) and the
#: blob behind a large object (its reference names it)
_UNNAMED = re.compile(r"\.(s\d{3}|blob-[0-9a-f]+)$")
#: how many names ``grad-<i>-<k>`` a replica tries past its restart count (an older life or launch took some)
_GRAD_TRIES = 64
#: the kinds of :attr:`RoundStore.bytes_by_kind`
WRITE_KINDS = ("grad", "mean", "state", "init")


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
        check_decoded(vec[lo:hi], decoded[-1], compress)
    return out, torch.cat(decoded)


class StoreObjectError(ComposerPluginsError, RuntimeError):
    """An object the run cannot do without (run.json, a manifest, every state) is not a DiLoCo data object."""


class ForeignObjectError(CorruptObjectError):
    """An object in the run directory belongs to another run (its run id differs, or it carries none): refused
    like a damaged one (docs/diloco.md, "Resume and identity")."""

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
        # pseudo-gradient indexes read intact, by (round, name): each is created once, so read from the store once
        self._indexes: dict[tuple[int, str], dict[str, Any]] = {}
        #: bytes created here by kind: the sync log's ``bytes_by_kind``
        self.bytes_by_kind: dict[str, int] = dict.fromkeys(WRITE_KINDS, 0)
        self._lock = threading.Lock()  # the state writer thread counts too

    def _count(self, kind: str, n: int) -> int:
        with self._lock:
            self.bytes_by_kind[kind] += n
        return n

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
        """Create this replica's pseudo-gradient of round ``r`` from its encoded slices, its index last (so a listed
        index has its slices), as ``grad-<index>-<k>`` with the first free ``k >= restart``: ``(name, bytes)``."""
        d = self.round_dir(r)
        for k in range(restart, restart + _GRAD_TRIES):
            name = f"grad-{index}-{k}"
            # no HEAD first: a name an earlier life took fails its first create (a store round trip less per round)
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
                    return name, self._count("grad", nbytes + len(idx))
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

    def put_refused(self, r: int, index: int, reason: str) -> None:
        """Record that replica ``index`` has no pseudo-gradient for round ``r`` (``reason``), so the others close
        the round without waiting for it."""
        body = json.dumps({"reason": reason}).encode()
        data = pack({"kind": "refused", "run": self.run_id, "round": r, "replica": index}, body)
        self.store.put(f"{self.round_dir(r)}/refused-{index}", data, create=True)

    def refused(self, r: int) -> dict[int, str]:
        """``{replica: reason}`` of the replicas that said they have no pseudo-gradient for round ``r``."""
        out: dict[int, str] = {}
        for key in self.store.list(self.round_dir(r)):
            m = _REFUSED.search(key)
            data = self.store.get(key) if m else None
            if data is not None:
                try:
                    header, body = unpack(data, self._where(key))
                    self._ours(key, header)
                    out[int(m.group(1))] = str(json.loads(body)["reason"])  # type: ignore[union-attr]
                except (CorruptObjectError, ValueError, KeyError, TypeError) as e:
                    self._refuse(r, key, e)
        return out

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
                row_ok = isinstance(e, list) and len(e) == 3 and e[0] == lo and isinstance(e[2], str)
                if not (row_ok and isinstance(e[1], int) and e[1] >= lo):
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
        except CodecError:  # the codec broke its contract: stop here, naming it
            raise
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
        mine = decode_vector(header, body)
        check_decoded(vec, mine, compress)
        key = f"{self.round_dir(r)}/mean-{j:03d}"
        data = pack({**header, "kind": "mean", "run": self.run_id, "round": r, "slice": j, "count": count}, body)
        if self.store.put(key, data, create=True):
            self._count("mean", len(data))
            return mine, True
        stored = self.get_mean(r, j, vec.numel())
        if stored is None:  # pragma: no cover - a store that lost an object it said exists
            raise StoreObjectError(f"{self._where(key)} exists but cannot be read")
        return stored, False

    def get_mean(self, r: int, j: int, numel: int) -> torch.Tensor | None:
        """Slice ``j`` of round ``r``'s stored mean; ``None`` if not written yet; :class:`StoreObjectError` if it
        is not intact data (it was created once and cannot be replaced)."""

        def parse(key: str, header: dict[str, Any], body: bytes) -> torch.Tensor:
            if header.get("kind") != "mean" or header.get("round") != r or header.get("slice") != j:
                raise CorruptObjectError(f"{self._where(key)}: not slice {j} of round {r}'s mean")
            vec = decode_vector(header, body)
            if vec.numel() != numel or not bool(torch.isfinite(vec).all()):
                raise CorruptObjectError(f"{self._where(key)}: {vec.numel()} values for {numel}, or not finite")
            return vec

        why = f"refused (nothing in it was run); round {r}'s aggregate cannot be replaced"
        return self._round_object(r, f"{self.round_dir(r)}/mean-{j:03d}", parse, why)

    def _round_object(self, r: int, key: str, parse: Callable[[str, dict[str, Any], bytes], T], why: str) -> T | None:
        """``parse(key, header, body)`` of this run's round object ``key``; ``None`` if absent; an object that is
        not intact or that ``parse`` refuses raises :class:`StoreObjectError` (it was created once)."""
        data = self.store.get(key)
        if data is None:
            return None
        try:
            header, body = unpack(data, self._where(key))
            self._ours(key, header)
            return parse(key, header, body)
        except CodecError:  # the codec broke its contract: stop here, naming it
            raise
        except (CorruptObjectError, ValueError, KeyError, TypeError) as e:
            raise self._for_good(r, key, e, why) from e

    def _for_good(self, r: int, key: str, e: Exception | None, why: str) -> StoreObjectError:
        """The error for a round object that is not intact and cannot be replaced (it was created once)."""
        msg = self._where(key) if e is None else str(e)
        if e is not None and not msg.startswith(self.store.where):
            msg = f"{self._where(key)}: {one_line(e)}"
        hint = f"HINT: resume the run from a copy of the prefix without rounds/{r:08d} and later."
        return StoreObjectError(f"{msg}: {why}. {hint}")

    # -- the manifest -----------------------------------------------------------------
    def manifest(self, r: int) -> dict[str, Any] | None:
        def parse(key: str, header: dict[str, Any], body: bytes) -> dict[str, Any]:
            m = json.loads(body)
            ok = header.get("kind") == "manifest" and isinstance(m, dict) and m.get("round") == r
            ok = ok and isinstance(m.get("participants"), list) and isinstance(m.get("grads"), dict)
            ok = ok and isinstance(m.get("slices"), int) and m["slices"] >= 1
            ok = ok and sorted(int(i) for i in m["grads"]) == m["participants"]
            if not ok or not all(
                isinstance(n, str) and _GRAD.fullmatch(n) and n.split("-")[1] == i for i, n in m["grads"].items()
            ):
                raise self._for_good(r, key, None, f"not a manifest of round {r}")
            return m

        why = f"round {r}'s manifest is not a DiLoCo data object and cannot be replaced (it was created once)"
        return self._round_object(r, f"{self.round_dir(r)}/manifest.json", parse, why)

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
    def put_state(self, key: str, state: dict[str, Any], create: bool = True, *, digest: str | None = None) -> int:
        """Write ``state`` (nested tensors and numbers) as data under ``key``; bytes written (0: it existed).
        ``digest``: the hash of its vectors (:func:`.statehash.state_hash`), recorded for the rounds replayed on it."""
        kind = key.split("/")[0]
        tree, body = encode_tree(state, f"{kind}")
        header: dict[str, Any] = {"kind": kind, "run": self.run_id, "tree": tree}
        if digest is not None:
            header["hash"] = digest
        data = pack(header, body)
        return (
            self._count("init" if kind == "init" else "state", len(data))
            if self.store.put(key, data, create=create)
            else 0
        )

    def get_state(self, key: str) -> dict[str, Any] | None:
        """The state under ``key``; ``None`` if absent; :class:`CorruptObjectError` (naming it) if not intact data
        or its vectors do not match the hash it records."""
        data = self.store.get(key)
        if data is None:
            return None
        header, body = unpack(data, self._where(key))
        kind = key.split("/")[0]
        self._ours(key, header)
        if header.get("kind") != kind or "tree" not in header:
            raise CorruptObjectError(f"{self._where(key)}: not a DiLoCo {kind} object (kind {header.get('kind')!r})")
        if "delta" in header:
            raise CorruptObjectError(
                f"{self._where(key)}: a delta state (written by an earlier version with diloco.exact_every > 1, which "
                "this one neither writes nor reads). HINT: continue that run with the version that wrote it"
            )
        state = decode_tree(header["tree"], body, self._where(key))
        if not isinstance(state, dict):
            raise CorruptObjectError(f"{self._where(key)}: not a state mapping")
        digest = header.get("hash")
        if digest is not None and state_hash(flatten(state)) != digest:
            raise CorruptObjectError(f"{self._where(key)}: its vectors do not match the hash it records")
        return state

    def state_rounds(self) -> list[int]:
        """Rounds with a ``state/<r>`` object, newest first."""
        return sorted(
            (int(k.rsplit("/", 1)[1]) for k in self.store.list("state") if k.rsplit("/", 1)[1].isdigit()), reverse=True
        )

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

    def collect_garbage(self, newest: int, keep_rounds: int) -> int:
        """Delete states older than the newest ``keep_rounds`` and the pseudo-gradients and means of rounds those
        can no longer rebuild; manifests stay (docs/diloco.md, ``keep_rounds``)."""
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
            # a manifest stays, so a straggler still in that round finds it closed and never closes it again
            in_old_round = len(parts) >= 2 and parts[-2].isdigit() and int(parts[-2]) <= oldest_kept
            if in_old_round and any(k in parts[-1] for k in ("grad-", "mean-", "refused-")):
                self.store.delete(key)
                n += 1
        return n
