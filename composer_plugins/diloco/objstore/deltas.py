"""Global states as compressed deltas (``diloco.exact_every``): a state is either exact (fp32, as ``state/<r>``
always was) or a delta from the previous saved state, encoded with the run's codec and naming its base state's
key and hash.

The delta is taken against the *decoded* previous state (the chain), not against the previous exact weights, so
what a codec loses does not accumulate along the chain; and every replica, not only the one that writes it, takes
the decoded state as its global state at each state round (:meth:`StatesMixin._state_point`). The codecs'
bytes are deterministic and every replica holds the same global state, so they all compute the same chain: a
replica restarted from a delta state holds bit for bit what the others hold, and they end on one hash. A state's
vectors are its tensors of one or more dimensions (the weights, the outer momentum); scalars (an optimizer's step)
travel verbatim in its skeleton.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from composer_plugins.diloco.store import decode_vector, encode_vector

#: a state's vector, in its skeleton: ``{SLOT: shape}`` (the values are in the flat vector, in walk order)
SLOT = "__delta_slot__"


def flatten(state: Any) -> tuple[Any, torch.Tensor]:
    """``(skeleton, flat fp32 vector)`` of a state: every floating tensor of one or more dimensions becomes
    ``{SLOT: shape}`` in the skeleton and its values go, in walk order, into the flat vector."""
    parts: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.dtype == torch.float32:
            parts.append(x.detach().reshape(-1))
            return {SLOT: list(x.shape)}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    skeleton = walk(state)
    flat = torch.cat(parts) if parts else torch.zeros(0)
    return skeleton, flat


def unflatten(skeleton: Any, flat: torch.Tensor, where: str = "state") -> Any:
    """The state of :func:`flatten`'s ``skeleton`` with its vectors taken from ``flat`` (copies); ``ValueError``
    (naming ``where``) when the sizes do not add up."""
    off = 0

    def walk(x: Any) -> Any:
        nonlocal off
        if isinstance(x, dict) and len(x) == 1 and SLOT in x:
            shape = [int(s) for s in x[SLOT]]
            n = 1
            for s in shape:
                n *= s
            if off + n > flat.numel():
                raise ValueError(f"{where}: its skeleton needs more than the {flat.numel()} values of its vector")
            t = flat[off : off + n].clone().view(shape)
            off += n
            return t
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    out = walk(skeleton)
    if off != flat.numel():
        raise ValueError(f"{where}: its skeleton takes {off} values of a vector of {flat.numel()}")
    return out


def state_hash(flat: torch.Tensor) -> str:
    """SHA-256 (hex) of a state's flat vector: equal exactly when the vectors are bitwise equal."""
    t = flat.detach().to("cpu", torch.float32).contiguous()  # a state on the GPU is hashed from its host copy
    return hashlib.sha256(
        t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    ).hexdigest()  # device-ok: t is on the CPU


def encode_delta(flat: torch.Tensor, chain: torch.Tensor, compress: str) -> tuple[dict[str, Any], bytes, torch.Tensor]:
    """``(codec header, body, the new chain)``: ``flat - chain`` through ``compress``, and ``chain`` plus what a
    reader decodes from it (what every replica takes as the state)."""
    if flat.numel() != chain.numel():
        raise ValueError(f"a state of {flat.numel()} values against a previous one of {chain.numel()}")
    header, body = encode_vector((flat - chain).contiguous(), compress)
    return header, body, apply_delta(chain, header, body)


def apply_delta(chain: torch.Tensor, header: dict[str, Any], body: bytes) -> torch.Tensor:
    """The state a delta stands for: its base's vector plus the decoded delta."""
    d = decode_vector(header, body)
    if d.numel() != chain.numel():
        raise ValueError(f"a delta of {d.numel()} values on a state of {chain.numel()}")
    return chain + d
