"""A codec that breaks its contract is named at once (issue 51): a codec that decodes a finite pseudo-gradient to
NaN stops the replica that decoded it with an error naming the codec, its plugin and ``diloco.compress`` (not
the learning rate), and that replica's refusal, written to the round, lets the others close the round at once
instead of waiting out ``diloco.round_timeout_s``."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from test_diloco_aggregate import _replicas

from composer_plugins import hookimpl
from composer_plugins.core import plugins
from composer_plugins.diloco.codecs import Codec, CodecError, decode_vector, encode_vector
from composer_plugins.diloco.objstore.rounds import encode_slices


class _NaNOnce(Codec):
    """fp32 bytes; the first decode of a vector this process encodes (not one read from the store) gives NaN."""

    armed = True
    lock = threading.Lock()

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        return {}, vec.numpy().tobytes()

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        out = torch.frombuffer(bytearray(body), dtype=torch.float32).clone() if numel else torch.zeros(0)
        with self.lock:
            if "kind" not in header and type(self).armed:
                type(self).armed = False
                out.fill_(float("nan"))
        return out


class _Half(_NaNOnce):
    """Decodes to fp16 (a dtype the contract forbids)."""

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(body), dtype=torch.float32).to(torch.float16)


class _Plugin:
    __name__ = "nan_codec_plugin"

    @hookimpl
    def register_codecs(self, register: Any) -> None:
        register("nanonce", _NaNOnce)
        register("half", _Half)


@pytest.fixture
def nan_codec(isolated_plugins):
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(_Plugin(), name="nan_codec_plugin")
    plugins.use_plugin_manager(pm)
    _NaNOnce.armed = True
    yield


def test_codec_decoding_finite_values_to_nan_is_named_at_once(nan_codec):
    with pytest.raises(CodecError) as e:
        encode_slices(torch.ones(10), "nanonce", 2)
    msg = str(e.value)
    for part in ("codec 'nanonce'", "plugin 'nan_codec_plugin'", "diloco.compress='nanonce'", "5 of 5 finite"):
        assert part in msg, msg
    assert "learning rate" not in msg
    # a non-finite input that decodes to non-finite is the replica's own (the reader leaves it out), not the codec's
    _NaNOnce.armed = False
    _, got = encode_slices(torch.tensor([1.0, float("nan")]), "nanonce", 1)
    assert got.isnan().sum() == 1
    # shape and dtype: named the same way
    h, body = encode_vector(torch.ones(4), "half")
    with pytest.raises(
        CodecError,
        match=r"codec 'half' \(plugin 'nan_codec_plugin'\) decoded a torch.float16.*"
        r"diloco.compress='half'",
    ):
        decode_vector(h, body)


def test_a_replica_whose_codec_fails_stops_and_the_others_do_not_wait(nan_codec, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(CodecError, match="codec 'nanonce'"):
        _replicas(f"file://{tmp_path}/nan", 2, 3, compress="nanonce", round_timeout_s=60.0, keep_rounds=0)
    # the healthy replica closed every round without the failed one, well inside one round_timeout_s
    assert time.monotonic() - t0 < 30


def test_a_lone_replica_whose_pseudo_gradient_is_not_finite_waits_two_timeouts_then_names_the_round(tmp_path):
    """Replica 0 of 2 publishes nothing (its pseudo-gradient is NaN: ``refused-0``) and replica 1 never comes: it
    waits ``2 × round_timeout_s`` for a readable pseudo-gradient, then stops naming the round, not earlier."""
    from composer_plugins.core.errors import ComposerPluginsError
    from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
    from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = DiLoCoConfig(
        transport="object_store",
        store=f"file://{tmp_path}/lone",
        run_id="lone",
        sync_every=1,
        outer_steps=2,
        round_timeout_s=1.0,
        poll_s=0.01,
        init_sync=False,
    )
    cb = ObjectStoreDiLoCoCallback(config, ReplicaInfo(index=0, num_replicas=2, run_id="lone"))
    cb.attach(model, opt)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    t0 = time.monotonic()
    with pytest.raises(
        ComposerPluginsError, match=r"round 0: no readable pseudo-gradient .* 2 x diloco.round_timeout_s=1s"
    ):
        opt.step()
    assert time.monotonic() - t0 >= 1.9
    assert cb.rounds is not None and cb.rounds.refused(0) == {0: "its pseudo-gradient is not finite"}
    cb.close()
