"""The object store transport's smaller guarantees, each on a real ``file://`` store: data-only codecs, keys a
transport ignores refused, the transport registry, the If-None-Match probe, non-finite pseudo-gradients left
out, URLs redacted, and old rounds collected."""

from __future__ import annotations

import hashlib
import pickle
import re

import pytest
import torch

from composer_plugins.core.errors import ConfigError
from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback, RoundStore, encode_slices
from composer_plugins.diloco.store import (
    CorruptObjectError,
    ObjectStore,
    decode_tree,
    encode_tree,
    encode_vector,
    pack,
    redact_url,
)
from composer_plugins.diloco.transports import get_transport


def test_state_tree_round_trips_optimizer_state_and_refuses_what_is_not_data():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), betas=(0.9, 0.95))
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "opt": opt.state_dict(), "misc": [1, 2.5, None, "a", (1, 2), torch.tensor(True)]}
    tree, body = encode_tree(state)
    back = decode_tree(tree, body)
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.95) and 0 in back["opt"]["state"]
    assert all(torch.equal(back["model"][k], v) for k, v in m.state_dict().items())
    torch.optim.AdamW(torch.nn.Linear(3, 2).parameters()).load_state_dict(back["opt"])
    with pytest.raises(TypeError, match=r"state\['f'\]: a builtin_function_or_method cannot be stored"):
        encode_tree({"f": print})
    for bad in ({"P": pickle.dumps(1).hex()}, {"X": ["object", [1], 0, 1]}, {"X": ["float32", [4], 0, 16]}):
        with pytest.raises(CorruptObjectError):
            decode_tree(bad, b"\0" * 4)


def test_keys_the_transport_ignores_are_refused_and_unknown_transports_suggested():
    with pytest.raises(ConfigError, match="diloco.min_replica_size.*object_store does not use"):
        DiLoCoConfig(transport="object_store", min_replica_size=2).validate()
    with pytest.raises(ConfigError, match="diloco.compress.*torchft does not use"):
        DiLoCoConfig(compress="int8").validate()
    with pytest.raises(ConfigError, match="Did you mean 'object_store'"):
        DiLoCoConfig(transport="object_stor").validate()
    assert {get_transport(n).needs for n in ("torchft", "object_store")} == {"lighthouse", "store"}
    assert get_transport("object_store").cloud and not get_transport("torchft").cloud


def test_store_that_ignores_if_none_match_is_refused(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/probe"
    real = ObjectStore.put
    monkeypatch.setattr(ObjectStore, "put", lambda self, key, data, create=False: real(self, key, data))
    cb = ObjectStoreDiLoCoCallback(DiLoCoConfig(transport="object_store", store=url), ReplicaInfo(run_id="probe"))
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="If-None-Match"):
        cb.attach(m, torch.optim.SGD(m.parameters(), lr=0.1))


def test_non_finite_pseudo_gradient_is_left_out(tmp_path):
    rs = RoundStore(ObjectStore(f"file://{tmp_path}/nan"))
    ok, bad = torch.ones(8), torch.ones(8)
    bad[3] = float("nan")
    for i, v in enumerate((ok, bad)):
        rs.put_grad(0, i, 0, encode_slices(v, "none", 2)[0])
    assert torch.equal(rs.read_grad(0, "grad-0-0", 8), ok)
    assert rs.read_grad(0, "grad-1-0", 8) is None
    assert rs.read_grad(0, "grad-0-0", 9) is None  # another model's size


def test_urls_are_redacted_to_scheme_bucket_prefix():
    assert redact_url("https://user:pw@host.example/bucket/run?sig=SECRET&se=1") == "https://host.example/bucket/run"
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    with pytest.raises(ConfigError) as e:
        DiLoCoConfig(transport="object_store", store="s4://b/p?sig=SECRET").validate()
    assert "SECRET" not in str(e.value)
    # what the training module saves as hyperparameters (and MLflow logs as params) goes through core's redact
    from composer_plugins.core.config import redact

    saved = redact({"diloco": {"store": "https://acct.blob.example/c/run?sv=1&sig=SECRET", "compress": "int8"}})
    assert saved == {"diloco": {"store": "https://acct.blob.example/c/run", "compress": "int8"}}


def test_old_states_and_pseudo_gradients_are_collected_but_manifests_stay(tmp_path):
    rs = RoundStore(ObjectStore(f"file://{tmp_path}/gc"))
    for r in range(5):
        rs.put_grad(r, 0, 0, encode_slices(torch.ones(4), "none", 1)[0])
        rs.close_round(r, {0: "grad-0-0"}, 0)
        rs.put_state(f"state/{r:08d}", {"global_params": [torch.ones(4)]})
    rs.collect_garbage(4, keep_rounds=2)
    assert rs.state_rounds() == [4, 3]
    assert all(rs.manifest(r) is not None for r in range(5))
    assert [r for r in range(5) if rs.grads_present(r)] == [4]
    # a planted non-data state is refused and the newest valid one used
    rs.store.put("state/00000009", pack({"kind": "state"}, pickle.dumps({"x": 1})))
    k, state = rs.newest_valid_state()
    assert k == 4 and torch.equal(state["global_params"][0], torch.ones(4))


def test_int4_is_an_eighth_of_fp32_and_error_feedback_keeps_the_sum_unbiased():
    from composer_plugins.diloco.store import decode_vector

    g = torch.Generator().manual_seed(0)
    v = torch.randn(40_000, generator=g) * 1e-3
    fp32 = len(pack(*encode_vector(v, "none")))
    header, body = encode_vector(v, "int4")
    assert len(pack(header, body)) <= fp32 / 8, (len(pack(header, body)), fp32)
    once = float((decode_vector(header, body) - v).norm() / v.norm())
    assert once < 0.2
    # the same pseudo-gradient for 20 rounds: with the residual carried, the sum of what was sent stays within
    # one round's rounding error of the true sum (without it, the error would grow with the rounds)
    residual, sent = torch.zeros_like(v), torch.zeros_like(v)
    for _ in range(20):
        x = v + residual
        d = decode_vector(*encode_vector(x, "int4"))
        residual = x - d
        sent += d
    assert float((sent - 20 * v).norm() / (20 * v).norm()) < once / 5


def test_int4_round_trips_its_edge_cases_and_refuses_corrupt_bodies_with_a_located_error(tmp_path, caplog):
    from composer_plugins.diloco.store import INT4_BLOCK, decode_vector

    g = torch.Generator().manual_seed(1)
    # Adam-like pseudo-gradients (near-uniform codes: deflate cannot help, the codes go raw) and peaked ones
    for v in (torch.rand(3 * INT4_BLOCK + 5, generator=g) - 0.5, torch.randn(4000, generator=g) * 1e-5):
        header, body = encode_vector(v, "int4")
        assert len(body) <= (v.numel() + 1) // 2 + -(-v.numel() // INT4_BLOCK) + 1
        d = decode_vector(header, body)
        # the step of a block is at most 2**(1/8) times absmax / 7: each value within half of it
        blocks = torch.nn.functional.pad(v, (0, (-v.numel()) % INT4_BLOCK)).view(-1, INT4_BLOCK)
        step = (blocks.abs().amax(1) / 7 * 2 ** (1 / 8)).repeat_interleave(INT4_BLOCK)[: v.numel()]
        assert bool(((d - v).abs() <= step / 2 * 1.001).all())
    zeros = decode_vector(*encode_vector(torch.zeros(300), "int4"))
    assert torch.equal(zeros, torch.zeros(300))
    assert decode_vector(*encode_vector(torch.zeros(0), "int4")).numel() == 0
    # a block holding inf decodes as NaN, so the reader's finiteness check leaves that replica out
    assert not bool(torch.isfinite(decode_vector(*encode_vector(torch.tensor([1.0, float("inf")]), "int4"))).all())

    header, body = encode_vector(torch.randn(1000, generator=g), "int4")
    assert body[0] == 1  # peaked values: the codes went through deflate
    corrupt = {
        "a truncated body": (header, body[:-7]),
        "a missing scale table": (header, body[:2]),
        "an unknown flag": (header, bytes([9]) + body[1:]),
        "more values than the body": ({**header, "numel": 5000}, body),
        "codes that do not inflate": (header, body[:5] + bytes(b ^ 0x5A for b in body[5:])),
    }
    for what, (h, b) in corrupt.items():
        with pytest.raises(CorruptObjectError, match="int4"):
            decode_vector(h, b)
            pytest.fail(what)
    # through the store: a slice whose bytes were replaced (checksum fixed up) is refused naming its key
    rs = RoundStore(ObjectStore(f"file://{tmp_path}/s"))
    slices, _ = encode_slices(torch.randn(1000, generator=g), "int4", 2)
    name, _ = rs.put_grad(0, 0, 0, slices)
    index = rs.read_grad_index(0, name)
    assert index is not None
    key = f"rounds/00000000/{name}.s001"
    h, b = slices[1]
    forged = pack({**h, "kind": "grad-slice", "round": 0, "replica": 0, "slice": 1}, bytes([1]) + b[1:5] + b"junk")
    rs.store.put(key, forged)
    index["slices"][1][2] = hashlib.sha256(forged).hexdigest()
    with caplog.at_level("WARNING", logger="composer_plugins.diloco.objstore"):
        assert rs.read_grad_slice(0, name, index, 1) is None
    assert any(key in m and "int4" in m for m in caplog.messages), caplog.messages


def test_a_pseudo_gradient_name_taken_by_an_earlier_life_is_skipped_without_a_head_request(tmp_path):
    rs = RoundStore(ObjectStore(f"file://{tmp_path}/s"))
    slices, _ = encode_slices(torch.arange(10.0), "none", 2)
    assert rs.put_grad(3, 1, 0, slices)[0] == "grad-1-0"
    # an earlier life that died between its slices and its index: slice 0 of grad-1-1 only
    rs.store.put("rounds/00000003/grad-1-1.s000", b"orphan", create=True)
    heads: list[str] = []
    exists = rs.store.exists
    rs.store.exists = lambda key: (heads.append(key), exists(key))[1]  # type: ignore[method-assign]
    name, _ = rs.put_grad(3, 1, 0, slices)
    assert name == "grad-1-2" and not heads
    assert rs.grads_present(3) == {1: ["grad-1-2", "grad-1-0"]}
    assert torch.equal(rs.read_grad(3, name, 10), torch.arange(10.0))


def test_each_section_validates_itself_before_any_replica_starts():
    """``diloco:``, its ``jobs:`` subsection and ``toy:`` each check their own values, located at the override."""
    from composer_plugins.diloco.run import check_replica_config

    for override, where in (
        ("diloco.jobs.poll_s=0", "diloco.jobs.poll_s: must be > 0, got 0"),
        ("toy.n_heads=3", "toy.n_heads: must divide d_model (32), got 3"),
        ("toy.max_steps=-1", "toy.max_steps: must be >= 0, got -1"),
        ("diloco.sync_every=0", "diloco.sync_every: must be >= 1, got 0"),
    ):
        with pytest.raises(ConfigError, match=re.escape(where)):
            check_replica_config("toy", None, [override])
    with pytest.raises(ConfigError, match=r"diloco\.jobs\.imag.*unknown key"):
        check_replica_config("toy", None, ["diloco.jobs.imag=x"])
    assert check_replica_config("toy", None, ["diloco.jobs.image=img"]).jobs == {"image": "img"}
