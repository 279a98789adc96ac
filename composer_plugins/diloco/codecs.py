"""Pseudo-gradient codecs (``diloco.compress``): a registered plugin kind, ``codecs``.

A codec (:class:`Codec`) turns a flat fp32 CPU vector into header fields and a body, and back; the object-store
transport writes every pseudo-gradient slice and mean slice through :func:`encode_vector` / :func:`decode_vector`.
The contract (:func:`composer_plugins.testing.conformance.check_codec`) and an example: docs/plugins.md,
"register_codecs".
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from composer_plugins.core.errors import ComposerPluginsError, one_line

__all__ = [
    "Codec",
    "CodecError",
    "CorruptObjectError",
    "check_decoded",
    "codec_label",
    "decode_vector",
    "encode_vector",
    "get_codec",
    "host_tensor",
]

INT8_BLOCK = 4096
INT4_BLOCK = 256


class CorruptObjectError(ComposerPluginsError, ValueError):
    """An object's bytes do not match its checksum (torn write, truncation, bit rot)."""


class CodecError(CorruptObjectError):
    """A codec returned what its contract forbids (wrong shape or dtype, or non-finite values from finite input):
    the codec is at fault, not the object, so the replica that decoded it stops at once, naming it."""

    def __init__(self, what: str, compress: str) -> None:
        super().__init__(
            f"{what} (diloco.compress={compress!r}). HINT: fix that codec's decode, or set diloco.compress to a "
            "built-in codec (none, bf16, int8, int4)."
        )


def codec_label(name: str) -> str:
    """``codec 'x' (dist version (plugin 'p'))``: the codec and the package that registered it."""
    from composer_plugins.core.errors import UnknownPluginError
    from composer_plugins.core.plugins import get_registry

    try:
        entry = get_registry().get("codecs", name)
    except UnknownPluginError:  # a label only; an unknown name is reported where it is built
        return f"codec {name!r}"
    who = f"{entry.provider} " if entry.provider else ""
    return f"codec {name!r} ({who}plugin {entry.plugin!r})"


def check_decoded(src: torch.Tensor, decoded: torch.Tensor, compress: str) -> None:
    """Raise :class:`CodecError` when ``decoded`` (the round trip of ``src``) is not finite where ``src`` is."""
    bad = int((torch.isfinite(src) & ~torch.isfinite(decoded)).sum())
    if bad:
        raise CodecError(
            f"{codec_label(compress)} decoded {bad} of {src.numel()} finite pseudo-gradient values to NaN/inf", compress
        )


# -- host tensors only --------------------------------------------------------------------


def host_tensor(t: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """Check that ``t`` is a plain CPU tensor (what every codec here reads and returns)."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise TypeError(f"{what}: the store codecs take plain CPU tensors, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{what}: the store codecs take CPU tensors, got one on {t.device} (call .cpu() first)")
    return t


# -- pseudo-gradient codecs ---------------------------------------------------------------


def encode_vector(vec: torch.Tensor, compress: str, codec: Codec | None = None) -> tuple[dict[str, Any], bytes]:
    """Header fields (``codec``, ``numel`` and the codec's own) and body of a flat fp32 CPU vector under the
    registered codec ``compress``."""
    v = host_tensor(vec, "encode_vector").detach().to(torch.float32).contiguous().view(-1)
    codec = codec if codec is not None else get_codec(compress)
    fields, body = codec.encode(v)
    if not isinstance(fields, dict) or not isinstance(body, (bytes, bytearray)):
        raise TypeError(
            f"codec {compress!r}: encode must return (dict of header fields, bytes), got "
            f"({type(fields).__name__}, {type(body).__name__})"
        )
    return {**fields, "codec": compress, "numel": v.numel()}, bytes(body)


#: int4 scale codes: 0 = an all-zero block, 255 = a block holding NaN/inf (decoded as NaN, so the reader's
#: finiteness check refuses it), k in 1..254 = a scale of 2 ** ((k - INT4_SCALE_BIAS) / INT4_SCALE_STEPS): 1/8
#: octave apart (a step at most 9 % coarser than absmax / 7), from 2**-24 (fp16's smallest) up to about 195
#: (values above about 1,366 are clipped to +-7 steps; error feedback carries the rest to the next round)
INT4_SCALE_STEPS = 8
INT4_SCALE_BIAS = 193
#: the int4 body: ``u8 flags | scale codes (one a block) | codes`` where the codes are two values a byte, raw
#: deflated when flags == 1 (kept as they are when deflate does not make them smaller: flags == 0)
_INT4_RAW, _INT4_DEFLATED = 0, 1


def _int4_scale_codes(absmax: torch.Tensor) -> torch.Tensor:
    """One byte per block: the smallest code whose scale is at least ``absmax / 7`` (see ``INT4_SCALE_*``)."""
    finite = torch.isfinite(absmax)
    a = torch.where(finite, absmax, torch.ones_like(absmax)) / 7.0
    k = torch.ceil(torch.log2(a.clamp_min(1e-38)) * INT4_SCALE_STEPS - 1e-4) + INT4_SCALE_BIAS
    k = k.clamp_(1, 254)
    k = torch.where(absmax > 0, k, torch.zeros_like(k))
    return torch.where(finite, k, torch.full_like(k, 255)).to(torch.uint8)


def _int4_scales(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of each code (0 for code 0, NaN for code 255)."""
    s = torch.exp2((codes.to(torch.float32) - INT4_SCALE_BIAS) / INT4_SCALE_STEPS)
    s = torch.where(codes == 0, torch.zeros_like(s), s)
    return torch.where(codes == 255, torch.full_like(s, float("nan")), s)


def decode_vector(header: dict[str, Any], body: bytes, codec: Codec | None = None) -> torch.Tensor:
    """The flat fp32 CPU vector of an :func:`encode_vector` payload; :class:`CorruptObjectError` (what is wrong)
    when the body is not what its header says, or no installed codec has its name."""
    from composer_plugins.core.errors import UnknownPluginError

    try:
        n, name = int(header["numel"]), header["codec"]
        if n < 0 or not isinstance(name, str):
            raise ValueError(f"numel {n}, codec {name!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptObjectError(f"not a pseudo-gradient header ({one_line(e)})") from e
    try:
        codec = codec if codec is not None else get_codec(name)
    except UnknownPluginError as e:
        raise CorruptObjectError(f"written with codec {name!r}, which is not installed here ({one_line(e)})") from e
    try:
        vec = codec.decode(header, body, n)
    except CorruptObjectError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, zlib.error) as e:
        raise CorruptObjectError(f"codec {name!r} cannot decode this body ({type(e).__name__}: {one_line(e)})") from e
    if type(vec) is not torch.Tensor or vec.device.type != "cpu" or vec.dtype != torch.float32 or vec.numel() != n:
        what = (
            f"a {vec.dtype} tensor on {vec.device} of {vec.numel()} values"
            if isinstance(vec, torch.Tensor)
            else f"a {type(vec).__name__}"
        )
        raise CodecError(f"{codec_label(name)} decoded {what} for {n} values (a plain fp32 CPU tensor)", name)
    return vec.reshape(-1)


# -- the codec plugin kind ---------------------------------------------------------------


class Codec:
    """The base of a pseudo-gradient codec (see the module docstring).

    Attributes:
        tolerance: the relative L2 error a round trip of a standard normal vector may have (``0``: lossless,
            bitwise). The conformance check holds the codec to it.
        error_feedback: lossy codecs carry the rounding error to the sender's next pseudo-gradient (and the
            writer of a round's mean carries the mean's rounding to the next mean it writes).
        feedback_decay: the carried error is multiplied by this before it is added (``1``: all of it; SparseLoCo's
            error feedback decays it, the accumulator then acting as the outer momentum).
        mean_codec: the registered codec a round's mean is written with (``None``: this one). A sparse codec's mean
            is the union of the replicas' entries: kept sparse (``sparse``) rather than sparsified a second time.
    """

    tolerance: float = 0.0
    error_feedback: bool = True
    feedback_decay: float = 1.0
    mean_codec: str | None = None

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        """Header fields (JSON values; ``codec`` and ``numel`` are added) and body of ``vec``: a contiguous fp32
        CPU tensor of one dimension."""
        raise NotImplementedError

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        """The fp32 CPU vector of ``numel`` values that ``body`` holds; :class:`CorruptObjectError` (or
        ``ValueError``) saying what is wrong when it is not what ``header`` says."""
        raise NotImplementedError


class NoneCodec(Codec):
    """fp32 values as they are (lossless; the bitwise parity with torchft holds with it)."""

    error_feedback = False

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        return {}, vec.numpy().tobytes()  # device-ok: encode_vector's host copy

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        if len(body) != 4 * numel:
            raise CorruptObjectError(f"fp32 body of {len(body)} bytes for {numel} values")
        return torch.frombuffer(bytearray(body), dtype=torch.float32).clone() if numel else torch.zeros(0)


class BF16Codec(Codec):
    """bf16 values: half the fp32 bytes, about 0.3 % relative error."""

    tolerance, error_feedback = 0.005, False

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        return {}, vec.to(torch.bfloat16).view(torch.int16).numpy().tobytes()  # device-ok: encode_vector's host copy

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        if len(body) != 2 * numel:
            raise CorruptObjectError(f"bf16 body of {len(body)} bytes for {numel} values")
        if not numel:
            return torch.zeros(0)
        return torch.frombuffer(bytearray(body), dtype=torch.int16).view(torch.bfloat16).to(torch.float32)


class Int8Codec(Codec):
    """int8 with a per-block absmax scale (blocks of 4096), deflated: at most a quarter of the fp32 bytes."""

    tolerance, error_feedback = 0.02, False

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        n = vec.numel()
        blocks = torch.nn.functional.pad(vec, (0, (-n) % INT8_BLOCK)).view(-1, INT8_BLOCK)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
        body = scale.numpy().tobytes() + zlib.compress(q.numpy().tobytes(), 6)  # device-ok: encode_vector's host copy
        return {"blocks": int(scale.numel())}, body

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        n, nb = numel, int(header["blocks"])
        if nb != -(-n // INT8_BLOCK) or len(body) < 4 * nb:
            raise CorruptObjectError(f"int8 header of {nb} blocks for {n} values")
        scale = torch.frombuffer(bytearray(body[: 4 * nb]), dtype=torch.float32) if nb else torch.zeros(0)
        z = zlib.decompressobj()
        try:
            raw = z.decompress(body[4 * nb :], n + 1)
        except zlib.error as e:
            raise CorruptObjectError(f"int8 body does not inflate ({e})") from e
        if not z.eof or z.unconsumed_tail or z.unused_data:
            raise CorruptObjectError(f"int8 body: a deflate stream that does not end after {n} values")
        if len(raw) != n:
            raise CorruptObjectError(f"int8 body of {len(raw)} values for {n}")
        if not n:
            return torch.zeros(0)
        q = torch.frombuffer(bytearray(raw), dtype=torch.int8).to(torch.float32)
        q = torch.nn.functional.pad(q, (0, nb * INT8_BLOCK - n)).view(nb, INT8_BLOCK)
        return (q * scale[:, None]).view(-1)[:n].contiguous()


class Int4Codec(Codec):
    """int4 with a one-byte log scale per block of 256, deflated, with error feedback: about an eighth.

    The body is laid out as ``INT4_SCALE_*`` and ``_INT4_RAW`` say: at most an eighth of fp32 plus a byte a block.
    """

    tolerance, error_feedback = 0.2, True

    def encode(self, v: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        n = v.numel()
        blocks = torch.nn.functional.pad(v, (0, (-n) % INT4_BLOCK)).view(-1, INT4_BLOCK)
        codes = _int4_scale_codes(blocks.abs().amax(dim=1))
        scale = _int4_scales(codes)
        safe = torch.where((codes > 0) & (codes < 255), scale, torch.ones_like(scale))
        q = (torch.round(blocks / safe[:, None]).clamp_(-7, 7) + 7).to(torch.uint8).view(-1)[: n + n % 2]
        # two values a byte; the last block's padding is not sent
        packed = ((q[0::2] << 4) | q[1::2]).numpy().tobytes()  # device-ok: v is encode_vector's host copy
        z = zlib.compressobj(9, zlib.DEFLATED, -15, 9)
        deflated = z.compress(packed) + z.flush()
        flag, payload = (_INT4_DEFLATED, deflated) if len(deflated) < len(packed) else (_INT4_RAW, packed)
        return {}, bytes([flag]) + codes.numpy().tobytes() + payload  # device-ok: v is encode_vector's host copy

    def decode(self, header: dict[str, Any], body: bytes, n: int) -> torch.Tensor:
        nb = -(-n // INT4_BLOCK)
        if n < 0 or len(body) < 1 + nb:
            raise CorruptObjectError(
                f"int4 body of {len(body)} bytes is shorter than its {nb} block scales for {n} values"
            )
        flag, want = body[0], (n + 1) // 2
        payload = body[1 + nb :]
        if flag == _INT4_DEFLATED:
            z = zlib.decompressobj(-15)
            try:
                raw = z.decompress(payload, want + 1)
            except zlib.error as e:
                raise CorruptObjectError(f"int4 codes do not inflate ({e})") from e
            if not z.eof or z.unconsumed_tail or z.unused_data:
                raise CorruptObjectError(f"int4 codes: a deflate stream that does not end after {want} bytes")
        elif flag == _INT4_RAW:
            raw = payload
        else:
            raise CorruptObjectError(f"int4 body flag {flag} (0 raw or 1 deflated)")
        if len(raw) != want:
            raise CorruptObjectError(f"int4 codes of {2 * len(raw)} values for {n}")
        empty = torch.zeros(0, dtype=torch.uint8)
        codes = torch.frombuffer(bytearray(body[1 : 1 + nb]), dtype=torch.uint8) if nb else empty
        packed = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if want else empty
        q = torch.stack([packed >> 4, packed & 15], dim=1).view(-1)
        if bool((q == 15).any()):
            raise CorruptObjectError("int4 codes outside [-7, 7]")
        vals = torch.nn.functional.pad(q.to(torch.float32) - 7.0, (0, nb * INT4_BLOCK - q.numel()))
        return (vals.view(nb, INT4_BLOCK) * _int4_scales(codes)[:, None]).view(-1)[:n].contiguous()


class SparseLoCoCodec(Codec):
    """Chunked top-k (2 % of each chunk), 2-bit values, packed indices, error feedback (SparseLoCo-class).

    Each chunk of ``chunk`` values sends its ``k = round(density * chunk)`` largest entries by magnitude: their
    indices in ascending order, ``ceil(log2 chunk)`` bits each, and one 2-bit code each (a sign bit and which
    half of ``[lo, hi]`` the magnitude falls in, decoded at that half's middle; ``lo``/``hi``, the chunk's
    smallest and largest sent magnitude, are two fp16 numbers per chunk). The rest is zero (error feedback).
    """

    error_feedback = True
    #: a round trip keeps only the largest ~2 %: most of a vector's norm comes later, through error feedback
    tolerance = 1.0

    def __init__(
        self, density: float = 0.02, chunk: int = 4096, feedback_decay: float = 1.0, mean_codec: str | None = "sparse"
    ) -> None:
        if not 0.0 < float(density) <= 1.0:
            raise ValueError(f"sparseloco density must be in (0, 1], got {density!r}")
        if not 2 <= int(chunk) <= 1 << 16:
            raise ValueError(f"sparseloco chunk must be in [2, 65536], got {chunk!r}")
        if not 0.0 <= float(feedback_decay) <= 1.0:
            raise ValueError(f"sparseloco feedback_decay must be in [0, 1], got {feedback_decay!r}")
        self.density, self.chunk = float(density), int(chunk)
        self.feedback_decay, self.mean_codec = float(feedback_decay), mean_codec
        self.k = max(1, round(self.density * self.chunk))
        self.index_bits = (self.chunk - 1).bit_length()

    def _ks(self, n: int) -> list[int]:
        full, rest = divmod(n, self.chunk)
        return [self.k] * full + ([min(self.k, max(1, round(self.density * rest)))] if rest else [])

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        import numpy as np

        n, c = vec.numel(), self.chunk
        ks = self._ks(n)
        idx_parts, val_parts = [], []
        full = (n // c) * c
        if full:
            blocks = vec[:full].view(-1, c)
            top = blocks.abs().topk(self.k, dim=1).indices.sort(dim=1).values
            idx_parts.append(top)
            val_parts.append(blocks.gather(1, top))
        if n > full:
            tail = vec[full:]
            top = tail.abs().topk(ks[-1]).indices.sort().values
            idx_parts.append(top[None])
            val_parts.append(tail[top][None])
        scales, codes = [], []
        for vals in val_parts:
            mag = vals.abs()
            lo, hi = mag.amin(dim=1).to(torch.float16), mag.amax(dim=1).to(torch.float16)
            lo32, hi32 = lo.to(torch.float32)[:, None], hi.to(torch.float32)[:, None]
            upper = (mag >= (lo32 + hi32) / 2).to(torch.uint8)
            codes.append(((vals < 0).to(torch.uint8) << 1 | upper).reshape(-1))
            scales.append(torch.stack([lo, hi], dim=1).reshape(-1))
        if not ks:
            return {"chunk": c, "k": self.k, "values": n}, b""
        idx = torch.cat([t.reshape(-1) for t in idx_parts]).to(torch.int64)
        bits = (idx[:, None] >> torch.arange(self.index_bits)) & 1  # device-ok: host tensors
        packed_idx = np.packbits(bits.to(torch.uint8).numpy().reshape(-1))  # device-ok: encode_vector's host copy
        code = torch.cat(codes)
        code_bits = torch.stack([code >> 1, code & 1], dim=1).reshape(-1)
        packed_codes = np.packbits(code_bits.numpy())  # device-ok: encode_vector's host copy
        scale_bytes = torch.cat(scales).view(torch.int16).numpy().tobytes()  # device-ok: encode_vector's host copy
        body = scale_bytes + packed_idx.tobytes() + packed_codes.tobytes()
        return {"chunk": c, "k": self.k, "values": n}, body

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        import numpy as np

        if header.get("values") != numel:
            raise CorruptObjectError(f"sparseloco body of {header.get('values')} values for {numel}")
        if header.get("chunk") != self.chunk or header.get("k") != self.k:
            raise CorruptObjectError(
                f"sparseloco body of chunk {header.get('chunk')}/k {header.get('k')}; this "
                f"codec reads chunk {self.chunk}/k {self.k}"
            )
        ks = self._ks(numel)
        m, nb = sum(ks), len(ks)
        n_scale, n_idx, n_code = 4 * nb, -(-m * self.index_bits // 8), -(-m * 2 // 8)
        if len(body) != n_scale + n_idx + n_code:
            raise CorruptObjectError(
                f"sparseloco body of {len(body)} bytes; {numel} values in {nb} chunks take {n_scale + n_idx + n_code}"
            )
        out = torch.zeros(numel)
        if not m:
            return out
        scales = torch.frombuffer(bytearray(body[:n_scale]), dtype=torch.float16).to(torch.float32).view(nb, 2)
        ib = np.unpackbits(np.frombuffer(body[n_scale : n_scale + n_idx], dtype=np.uint8))[: m * self.index_bits]
        idx = (torch.from_numpy(ib.astype(np.int64)).view(m, self.index_bits) << torch.arange(self.index_bits)).sum(1)
        cb = np.unpackbits(np.frombuffer(body[n_scale + n_idx :], dtype=np.uint8))[: 2 * m]
        cbt = torch.from_numpy(cb.astype(np.int64)).view(m, 2)
        sign, upper = cbt[:, 0], cbt[:, 1]
        chunk_of = torch.repeat_interleave(torch.arange(nb), torch.tensor(ks))
        lengths = torch.tensor([min(self.chunk, numel - j * self.chunk) for j in range(nb)])
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(ks).cumsum(0)[:-1]])
        ordered = idx[1:] > idx[:-1]
        ordered[starts[1:] - 1] = True  # a new chunk starts over
        if bool((idx >= lengths[chunk_of]).any()) or not bool(ordered.all()):  # device-ok: host tensors
            raise CorruptObjectError("sparseloco indices out of their chunk or not ascending")
        if not bool(torch.isfinite(scales).all()):
            raise CorruptObjectError("sparseloco chunk scales are not finite")
        bounds = scales[chunk_of]  # device-ok: host tensors
        lo, hi = bounds[:, 0], bounds[:, 1]
        mag = torch.where(upper.bool(), lo + 0.75 * (hi - lo), lo + 0.25 * (hi - lo))
        out[chunk_of * self.chunk + idx] = torch.where(sign.bool(), -mag, mag)  # device-ok: host tensors
        return out


class SparseCodec(Codec):
    """A mostly-zero vector's non-zero entries: a deflated bitmap of where they are and their values as fp16 scaled
    by the vector's largest magnitude (fp32); dense scaled fp16 when that is smaller (``sparseloco``'s mean)."""

    tolerance = 1e-3

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        import numpy as np

        n = vec.numel()
        scale = float(vec.abs().max()) if n else 0.0
        scale = scale if scale > 0 and scale < float("inf") else 1.0
        mask = vec != 0
        nnz = int(mask.sum())
        bitmap = zlib.compress(np.packbits(mask.numpy()).tobytes(), 6)  # device-ok: encode_vector's host copy
        if len(bitmap) + 2 * nnz < 2 * n:
            vals = (vec[mask] / scale).to(torch.float16).numpy().tobytes()  # device-ok: host tensors
            return {"form": "sparse", "scale": scale, "nnz": nnz, "bitmap": len(bitmap)}, bitmap + vals
        dense = (vec / scale).to(torch.float16).numpy().tobytes()  # device-ok: encode_vector's host copy
        return {"form": "dense", "scale": scale}, dense

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        import numpy as np

        scale = header.get("scale")
        if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise CorruptObjectError(f"sparse body with scale {scale!r}")
        if header.get("form") == "dense":
            if len(body) != 2 * numel:
                raise CorruptObjectError(f"sparse (dense form) body of {len(body)} bytes for {numel} values")
            return _scaled_fp16(body, scale)
        nnz, nb = header.get("nnz"), header.get("bitmap")
        if header.get("form") != "sparse" or not isinstance(nnz, int) or not isinstance(nb, int) or nb < 0:
            raise CorruptObjectError(f"sparse body of form {header.get('form')!r}")
        if len(body) != nb + 2 * nnz:
            raise CorruptObjectError(f"sparse body of {len(body)} bytes; a {nb}-byte bitmap and {nnz} values take more")
        try:
            bits = np.unpackbits(np.frombuffer(zlib.decompress(body[:nb]), dtype=np.uint8))
        except zlib.error as e:
            raise CorruptObjectError(f"sparse bitmap does not inflate ({e})") from e
        if bits.size != -(-numel // 8) * 8 or int(bits[numel:].sum()) or int(bits.sum()) != nnz:
            raise CorruptObjectError(f"sparse bitmap does not mark {nnz} of {numel} values")
        out = torch.zeros(numel)
        mask = torch.from_numpy(bits[:numel].astype(bool))
        out[mask] = _scaled_fp16(body[nb:], scale)
        return out


def _scaled_fp16(raw: bytes, scale: float) -> torch.Tensor:
    """The fp32 values of fp16 bytes ``raw``, times ``scale``."""
    return torch.frombuffer(bytearray(raw), dtype=torch.float16).to(torch.float32) * scale if raw else torch.zeros(0)


_cache: dict[tuple[int, str], Codec] = {}


def get_codec(name: str) -> Codec:
    """The registered codec ``name``, built once per registry; unknown names raise
    :class:`~composer_plugins.core.errors.UnknownPluginError` (the registered names, "did you mean")."""
    from composer_plugins.core.plugins import get_registry

    registry = get_registry()
    key = (id(registry), name)
    codec = _cache.get(key)
    if codec is None:
        codec = registry.get("codecs", name).build()
        if not (callable(getattr(codec, "encode", None)) and callable(getattr(codec, "decode", None))):
            raise TypeError(f"codec {name!r} built a {type(codec).__name__} without encode/decode methods")
        _cache[key] = codec
    return codec
