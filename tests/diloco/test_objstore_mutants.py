"""``RoundStore`` (``diloco/objstore/rounds.py``) object by object on a ``file://`` store: what each reader accepts,
what it refuses (and that it says where), and which objects garbage collection removes.

Written against the mutants that survived ``python -m benchmarks.mutation --only diloco/objstore``; the callback's
tests at the end (after the merge of issue 40's DiLoCo fixes) cover a replica joining a run: settings checked
against ``run.json``, catching up from a saved state, ``overlap: 1`` written out, another run's leftover objects.
"""

from __future__ import annotations

import hashlib
import json
import logging

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from composer_plugins.diloco.objstore import RoundStore, StoreObjectError, encode_slices, slice_bounds
from composer_plugins.diloco.store import CorruptObjectError, ObjectStore, encode_vector, pack, unpack

LOG = "composer_plugins.diloco.objstore"


class ThirdPartyFS(MemoryFileSystem):
    """A filesystem only fsspec knows (registered at run time, as a third-party package would): obstore cannot
    open ``thirdparty://``, so the store goes through fsspec."""

    protocol = ("thirdparty",)
    store: dict = {}
    pseudo_dirs: list = [""]


@pytest.fixture(params=["file", "thirdparty"])
def rs(tmp_path, request):
    if request.param == "file":
        return RoundStore(ObjectStore(f"file://{tmp_path}/run"))
    fsspec.register_implementation("thirdparty", ThirdPartyFS, clobber=True)
    ThirdPartyFS.store.clear()
    return RoundStore(ObjectStore(f"thirdparty://bucket/{tmp_path.name}"))


def test_a_store_url_of_a_third_party_fsspec_scheme_is_accepted_and_an_unknown_one_refused(rs):
    from composer_plugins.diloco.store import StoreError

    store = ObjectStore(rs.store.url, part_bytes=64)  # a large object: multipart, ranged reads, a reference
    assert store.put("a/big", b"x" * 200, create=True) and not store.put("a/big", b"y", create=True)
    assert store.get("a/big") == b"x" * 200 and store.list("a")[0] == "a/big"
    with pytest.raises(StoreError, match="unknown store scheme 'nosuchfs'.*registered with fsspec"):
        ObjectStore("nosuchfs://bucket/run")


def test_slice_bounds_cover_the_vector_in_contiguous_slices():
    assert slice_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert slice_bounds(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert slice_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert slice_bounds(0, 2) == [(0, 0), (0, 0)]
    assert slice_bounds(7, 1) == [(0, 7)]


def test_encode_slices_returns_what_the_readers_will_decode():
    v = torch.linspace(-1, 1, 11)
    out, dec = encode_slices(v, "bf16", 3)
    assert [h["numel"] for h, _ in out] == [4, 4, 3]
    assert torch.equal(dec, v.to(torch.bfloat16).float()) and not torch.equal(dec, v)
    out, dec = encode_slices(v, "none", 2)
    assert torch.equal(dec, v) and len(out) == 2


def test_a_pseudo_gradient_round_trips_and_its_index_records_every_slice(rs):
    v = torch.arange(10.0)
    slices, _ = encode_slices(v, "none", 3)
    name, nbytes = rs.put_grad(2, 1, 4, slices)
    assert name == "grad-1-4"
    keys = sorted(rs.store.list(rs.round_dir(2)))
    assert [k.rsplit("/", 1)[1] for k in keys] == ["grad-1-4", "grad-1-4.s000", "grad-1-4.s001", "grad-1-4.s002"]
    assert nbytes == sum(len(rs.store.get(k)) for k in keys)
    index = rs.read_grad_index(2, name)
    assert index["kind"] == "grad" and index["numel"] == 10 and index["restart"] == 4 and index["replica"] == 1
    assert [e[:2] for e in index["slices"]] == [[0, 4], [4, 8], [8, 10]]
    assert index["slices"][1][2] == hashlib.sha256(rs.store.get(f"{rs.round_dir(2)}/{name}.s001")).hexdigest()
    assert torch.equal(rs.read_grad(2, name, 10), v)
    assert rs.read_grad(2, name, 11) is None and rs.read_grad(2, "grad-1-5") is None
    assert rs.grads_present(2) == {1: ["grad-1-4"]} and rs.grads_present(3) == {}


def test_a_pseudo_gradient_index_records_its_slices_codec(rs):
    slices, decoded = encode_slices(torch.linspace(-1.0, 1.0, 9), "bf16", 2)
    name, _ = rs.put_grad(1, 0, 0, slices)
    assert rs.read_grad_index(1, name)["codec"] == "bf16"
    assert torch.equal(rs.read_grad(1, name, 9), decoded)


def test_every_name_taken_is_refused_with_the_range_tried(rs):
    slices, _ = encode_slices(torch.ones(2), "none", 1)
    for k in range(64):
        rs.store.put(f"{rs.round_dir(0)}/grad-0-{k}.s000", b"x", create=True)
    with pytest.raises(StoreObjectError, match=r"grad-0-0\.\.63 are all taken"):
        rs.put_grad(0, 0, 0, slices)
    assert rs.put_grad(0, 0, 64, slices)[0] == "grad-0-64"
    for k in range(65, 64 + 65):  # from a later restart: the range named starts there
        rs.store.put(f"{rs.round_dir(0)}/grad-0-{k}.s000", b"x", create=True)
    with pytest.raises(StoreObjectError, match=r"grad-0-65\.\.128 are all taken"):
        rs.put_grad(0, 0, 65, slices)


def test_a_state_whose_vectors_do_not_match_its_recorded_hash_is_refused(rs):
    from composer_plugins.diloco.objstore.statehash import flatten, state_hash

    state = {"round": 3, "global_params": [torch.arange(4.0)]}
    rs.put_state("state/00000003", state, digest=state_hash(flatten(state)))
    assert torch.equal(rs.get_state("state/00000003")["global_params"][0], torch.arange(4.0))
    other = {"round": 3, "global_params": [torch.ones(4)]}
    rs.put_state("state/00000004", other, digest=state_hash(flatten(state)))
    with pytest.raises(CorruptObjectError, match=r"state/00000004: its vectors do not match the hash it records"):
        rs.get_state("state/00000004")


def _index(rs, r, name, header):
    rs.store.put(f"{rs.round_dir(r)}/{name}", pack(header, b""))


@pytest.mark.parametrize(
    "header",
    [
        {"kind": "mean", "numel": 2, "slices": [[0, 2, "x"]]},
        {"kind": "grad", "numel": 2, "slices": []},
        {"kind": "grad", "numel": 2, "slices": "0-2"},
        {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [3, 4, "y"]]},  # a gap
        {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [2, 1, "y"]]},  # backwards
        {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [2, 4, 5]]},  # no checksum
        {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [2, 4]]},
        {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [2, "4", "y"]]},
        {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [2, 4.0, "y"]]},  # a bound that is not an int
        {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [2, 1, "y"], [1, 4, "z"]]},  # back, then to the end
        {"kind": "grad", "numel": 4, "slices": [[0, 4, "x", "extra"]]},
        {"kind": "grad", "numel": 5, "slices": [[0, 2, "x"], [2, 4, "y"]]},  # covers 4 of 5
    ],
)
def test_a_malformed_index_is_refused_and_logged_with_its_key(rs, caplog, header):
    _index(rs, 1, "grad-0-0", header)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert rs.read_grad_index(1, "grad-0-0") is None
    assert any("rounds/00000001/grad-0-0" in m and "refused" in m for m in caplog.messages), caplog.messages


def test_a_well_formed_index_is_read_once_and_its_size_checked(rs, caplog):
    _index(rs, 1, "grad-0-0", {"kind": "grad", "numel": 4, "slices": [[0, 2, "x"], [2, 4, "y"]]})
    assert rs.read_grad_index(1, "grad-0-0", 4)["numel"] == 4
    rs.store.delete(f"{rs.round_dir(1)}/grad-0-0")
    assert rs.read_grad_index(1, "grad-0-0")["numel"] == 4  # cached: not read again
    assert rs.read_grad_index(1, "grad-0-0", 5) is None
    _index(rs, 1, "grad-1-0", {"kind": "grad", "numel": 4, "slices": [[0, 4, "x"]]})
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert rs.read_grad_index(1, "grad-1-0", 6) is None
    assert any("has 4 values, the model 6" in m for m in caplog.messages), caplog.messages
    # rounds far behind the one being read are dropped from the cache
    _index(rs, 4, "grad-0-0", {"kind": "grad", "numel": 1, "slices": [[0, 1, "z"]]})
    rs.read_grad_index(4, "grad-0-0")
    assert (1, "grad-0-0") not in rs._indexes and (4, "grad-0-0") in rs._indexes
    _index(rs, 5, "grad-0-0", {"kind": "grad", "numel": 1, "slices": [[0, 1, "z"]]})
    rs.read_grad_index(5, "grad-0-0")
    assert (4, "grad-0-0") in rs._indexes
    _index(rs, 6, "grad-0-0", {"kind": "grad", "numel": 1, "slices": [[0, 1, "z"]]})
    rs.read_grad_index(6, "grad-0-0")
    assert (4, "grad-0-0") in rs._indexes  # r - 2 is still in flight
    _index(rs, 7, "grad-0-0", {"kind": "grad", "numel": 1, "slices": [[0, 1, "z"]]})
    rs.read_grad_index(7, "grad-0-0")
    assert (4, "grad-0-0") not in rs._indexes and (5, "grad-0-0") in rs._indexes


def test_slices_that_are_missing_forged_of_another_kind_or_size_are_refused(rs, caplog):
    v = torch.arange(6.0)
    slices, _ = encode_slices(v, "none", 2)
    name, _ = rs.put_grad(0, 0, 0, slices)
    index = rs.read_grad_index(0, name)
    assert torch.equal(rs.read_grad_slice(0, name, index, 1), v[3:])
    key = f"{rs.round_dir(0)}/{name}.s001"
    good = rs.store.get(key)
    h, body = slices[1]

    def forge(data):
        rs.store.put(key, data)
        return {**index, "slices": [index["slices"][0], [3, 6, hashlib.sha256(data).hexdigest()]]}

    with caplog.at_level(logging.WARNING, logger=LOG):
        rs.store.delete(key)
        assert rs.read_grad_slice(0, name, index, 1) is None
        assert any(f"{key} is missing" in m for m in caplog.messages)
        rs.store.put(key, good[:-1] + bytes([good[-1] ^ 1]))
        assert rs.read_grad_slice(0, name, index, 1) is None
        assert any("checksum" in m for m in caplog.messages)
        assert rs.read_grad_slice(0, name, forge(pack({**h, "kind": "mean"}, body)), 1) is None
        assert any("not a pseudo-gradient slice" in m for m in caplog.messages)
        h4, b4 = encode_vector(torch.ones(4), "none")
        assert rs.read_grad_slice(0, name, forge(pack({**h4, "kind": "grad-slice"}, b4)), 1) is None
        assert any("4 values for 3" in m for m in caplog.messages)
        h2, b2 = encode_vector(torch.ones(2), "none")  # a short slice too
        assert rs.read_grad_slice(0, name, forge(pack({**h2, "kind": "grad-slice"}, b2)), 1) is None
        assert any("2 values for 3" in m for m in caplog.messages)
        hn, bn = encode_vector(torch.tensor([1.0, float("inf"), 2.0]), "none")
        assert rs.read_grad_slice(0, name, forge(pack({**hn, "kind": "grad-slice"}, bn)), 1) is None
        assert any("non-finite" in m for m in caplog.messages)
    assert rs.read_grad(0, name) is None  # the index's own checksum no longer matches


def test_the_mean_is_created_once_and_everyone_applies_the_stored_bits(rs):
    a = torch.tensor([0.1, 0.2, 0.3])
    stored, created = rs.put_mean(5, 1, a, "bf16", 2)
    assert created and torch.equal(stored, a.to(torch.bfloat16).float())
    header, _ = unpack(rs.store.get(f"{rs.round_dir(5)}/mean-001"), "m")
    assert (header["kind"], header["round"], header["slice"], header["count"]) == ("mean", 5, 1, 2)
    again, created = rs.put_mean(5, 1, torch.tensor([9.0, 9.0, 9.0]), "none", 3)
    assert not created and torch.equal(again, stored)
    assert rs.get_mean(5, 0, 3) is None and torch.equal(rs.get_mean(5, 1, 3), stored)


@pytest.mark.parametrize(
    "header_vec",
    [
        ({"kind": "grad", "round": 5, "slice": 0}, torch.ones(3)),
        ({"kind": "mean", "round": 4, "slice": 0}, torch.ones(3)),
        ({"kind": "mean", "round": 5, "slice": 1}, torch.ones(3)),
        ({"kind": "mean", "round": 5, "slice": 0}, torch.ones(4)),
        ({"kind": "mean", "round": 5, "slice": 0}, torch.tensor([1.0, float("nan"), 1.0])),
    ],
)
def test_a_mean_that_is_not_intact_data_stops_the_run_naming_its_key(rs, header_vec):
    extra, vec = header_vec
    h, body = encode_vector(vec, "none")
    rs.store.put(f"{rs.round_dir(5)}/mean-000", pack({**h, **extra}, body))
    with pytest.raises(StoreObjectError, match=r"rounds/00000005/mean-000.*rounds/00000005 and later"):
        rs.get_mean(5, 0, 3)


@pytest.mark.parametrize("header", [b"[1, 2]", b"7", b"null"])
def test_an_object_whose_header_is_json_but_not_an_object_is_refused_where_it_is_read(rs, caplog, header):
    """Issue 67 item 3: one junk object in the run's prefix (its header valid JSON, not an object) is a located
    refusal for every reader, never an ``AttributeError``."""
    import struct

    from composer_plugins.diloco.store import MAGIC

    junk = MAGIC + struct.pack("<I", len(header)) + header + b"body"
    what = r"its header is a JSON \w+, not an object"
    rs.store.put(f"{rs.round_dir(2)}/mean-000", junk)
    with pytest.raises(StoreObjectError, match=rf"{rs.store.where}/rounds/00000002/mean-000: {what}"):
        rs.get_mean(2, 0, 3)
    rs.store.put(f"{rs.round_dir(2)}/manifest.json", junk)
    with pytest.raises(StoreObjectError, match=rf"rounds/00000002/manifest\.json: {what}"):
        rs.manifest(2)
    rs.store.put("state/00000004", junk)
    with pytest.raises(CorruptObjectError, match=rf"state/00000004: {what}"):
        rs.get_state("state/00000004")
    rs.store.put(f"{rs.round_dir(2)}/grad-1-0", junk)
    rs.store.put(f"{rs.round_dir(2)}/refused-1", junk)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert rs.read_grad_index(2, "grad-1-0") is None and rs.refused(2) == {}
    for key in ("grad-1-0", "refused-1"):
        assert any(f"rounds/00000002/{key}: its header is a JSON" in m for m in caplog.messages), caplog.messages


def test_a_replica_finding_a_run_json_whose_header_is_not_an_object_is_refused_naming_it(tmp_path):
    import struct

    from composer_plugins.core.errors import ConfigError
    from composer_plugins.diloco.store import MAGIC

    ObjectStore(f"file://{tmp_path}/run").put("run.json", MAGIC + struct.pack("<I", 6) + b"[1, 2]" + b"{}")
    with pytest.raises(ConfigError, match=r"run/run\.json: .*its header is a JSON list, not an object.*damaged"):
        _attach(f"file://{tmp_path}/run")


def test_manifests_are_created_once_and_validated(rs):
    m, created = rs.close_round(3, {1: "grad-1-0", 0: "grad-0-2"}, closer=1, slices=2)
    assert created and m["participants"] == [0, 1] and m["grads"] == {"0": "grad-0-2", "1": "grad-1-0"}
    assert m["slices"] == 2 and m["closed_by"] == 1 and m["round"] == 3
    assert rs.manifest(3) == m and rs.manifest(4) is None
    other, created = rs.close_round(3, {0: "grad-0-2"}, closer=0)
    assert not created and other == m  # the first close stands
    key = f"{rs.round_dir(7)}/manifest.json"
    good = {"round": 7, "participants": [0], "grads": {"0": "grad-0-0"}, "slices": 1}
    rs.store.put(key, pack({"kind": "manifest"}, json.dumps(good).encode()))
    assert rs.manifest(7) == good
    bad = [
        ({"kind": "state"}, good),
        ({"kind": "manifest"}, {**good, "round": 6}),
        ({"kind": "manifest"}, {**good, "participants": "0"}),
        ({"kind": "manifest"}, {**good, "grads": [["0", "grad-0-0"]]}),
        ({"kind": "manifest"}, {**good, "slices": 0}),
        ({"kind": "manifest"}, {**good, "slices": "1"}),
        ({"kind": "manifest"}, {**good, "participants": [1]}),
        ({"kind": "manifest"}, {**good, "grads": {"0": "grad-1-0"}}),
        ({"kind": "manifest"}, {**good, "participants": [1], "grads": {"1": "grad-0-0"}}),
        ({"kind": "manifest"}, {**good, "grads": {"0": "mean-000"}}),
    ]
    for header, body in bad:
        rs.store.put(key, pack(header, json.dumps(body).encode()))
        with pytest.raises(StoreObjectError, match=r"rounds/00000007/manifest\.json.*not a manifest of round 7"):
            rs.manifest(7)
    rs.store.put(key, pack({"kind": "manifest"}, b"{not json"))
    with pytest.raises(StoreObjectError, match=r"manifest is not a DiLoCo data object"):
        rs.manifest(7)


def test_states_are_data_of_their_kind_and_the_newest_intact_one_wins(rs, caplog):
    assert rs.put_state("state/00000002", {"global_params": [torch.ones(2)], "round": 2}) > 0
    assert rs.put_state("state/00000002", {"global_params": [torch.zeros(2)]}) == 0  # created once
    assert torch.equal(rs.get_state("state/00000002")["global_params"][0], torch.ones(2))
    assert rs.get_state("state/00000003") is None
    rs.put_state("state/00000010", {"round": 10})
    rs.store.put("state/notes", b"x")
    assert rs.state_rounds() == [10, 2]
    assert rs.newest_valid_state() == (10, {"round": 10})
    assert rs.newest_valid_state(at_least=11) is None
    only0 = RoundStore(ObjectStore(f"{rs.store.where}-0"))
    only0.put_state("state/00000000", {"round": 0})
    assert only0.newest_valid_state() == (0, {"round": 0})
    rs.put_state("replica/00000011", {"round": 11})
    rs.store.put("state/00000011", rs.store.get("replica/00000011"))  # a replica's object under the state key
    with pytest.raises(CorruptObjectError, match=r"state/00000011: not a DiLoCo state object \(kind 'replica'\)"):
        rs.get_state("state/00000011")
    with caplog.at_level(logging.ERROR, logger=LOG):
        assert rs.newest_valid_state(at_least=10) == (10, {"round": 10})
    assert any("state/00000011" in m for m in caplog.messages)
    assert rs.store.exists("state/00000002") and not rs.store.exists("state/00000003")


def test_garbage_collection_keeps_the_newest_states_and_what_they_can_rebuild(rs):
    for r in range(6):
        rs.put_grad(r, 0, 0, encode_slices(torch.ones(4), "none", 1)[0])
        rs.put_mean(r, 0, torch.ones(4), "none", 1)
        rs.close_round(r, {0: "grad-0-0"}, 0)
        rs.put_state(f"state/{r:08d}", {"round": r})
    assert rs.collect_garbage(5, keep_rounds=6) == 0
    assert rs.collect_garbage(1, keep_rounds=5) == 0  # only 2 states up to round 1
    assert rs.collect_garbage(3, keep_rounds=4) == 0  # only states up to round 3 count: 4 of them
    n = rs.collect_garbage(4, keep_rounds=3)  # states 4, 3, 2 kept; grads and means of rounds <= 2 go
    assert rs.state_rounds() == [5, 4, 3, 2]
    assert [r for r in range(6) if rs.grads_present(r)] == [3, 4, 5]
    assert [r for r in range(6) if rs.get_mean(r, 0, 4) is not None] == [3, 4, 5]
    assert all(rs.manifest(r) is not None for r in range(6))
    assert n == 2 + 3 * 3  # states 0, 1; rounds 0-2: grad index, its slice, the mean


# -- the callback, end to end in threads, against DiLoCo written out here --------------------------------------
H_IN, D_IN, D_OUT = 2, 6, 3


def _data(i: int) -> torch.Tensor:
    return torch.randn(16, D_IN, generator=torch.Generator().manual_seed(100 + i))


def _run_replicas(url: str, n: int, rounds: int, **cfg):
    import threading

    from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
    from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback

    out: list = [None] * n
    errors: list[BaseException] = []

    models = []
    for i in range(n):  # here, not in the threads: the global RNG is shared
        torch.manual_seed(i)
        models.append(torch.nn.Linear(D_IN, D_OUT))

    def replica(i: int) -> None:
        try:
            model = models[i]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            config = DiLoCoConfig(
                transport="object_store",
                store=url,
                run_id="ref",
                sync_every=H_IN,
                outer_steps=rounds,
                round_timeout_s=60.0,
                poll_s=0.01,
                **cfg,
            )
            cb = ObjectStoreDiLoCoCallback(config, ReplicaInfo(index=i, num_replicas=n, run_id="ref"))
            cb.attach(model, opt)
            x = _data(i)
            while not cb._stop:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            cb.close()
            out[i] = (cb, model)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _reference(n: int, rounds: int, compress: str, alpha: float):
    """DiLoCo by hand: everyone syncs to replica 0 at round 0; each round H inner SGD steps, the mean of the
    (codec-rounded) pseudo-gradients, Nesterov SGD on the global weights, local weights mixed by ``alpha``.
    int4 carries each replica's rounding to its next pseudo-gradient and each mean slice's rounding to that
    slice's next mean (each slice has one writer, so per slice is per writer)."""

    from composer_plugins.diloco.store import decode_vector, encode_vector

    def rnd(v: torch.Tensor) -> torch.Tensor:  # each of the n slices encoded on its own (int4's blocks restart)
        if compress == "none":
            return v
        step = -(-v.numel() // n)
        return torch.cat([decode_vector(*encode_vector(v[j * step : (j + 1) * step], compress)) for j in range(n)])

    residual = [torch.zeros(D_IN * D_OUT + D_OUT) for _ in range(n)]
    mean_residual = torch.zeros(D_IN * D_OUT + D_OUT)
    errs: list[list[float]] = []

    torch.manual_seed(0)
    init = torch.nn.Linear(D_IN, D_OUT)
    glob = [p.detach().clone().requires_grad_() for p in init.parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    locs = [[p.detach().clone() for p in glob] for _ in range(n)]
    states = []
    for r in range(rounds):
        pseudo = []
        errs.append([])
        for i in range(n):
            if r == 0 and i > 0:  # init_sync: at its first sync a replica takes replica 0's model (as torchft heals)
                locs[i] = [p.clone() for p in locs[0]]
                pseudo.append(pseudo[0].clone())
                residual[i] = residual[0].clone()
                errs[r].append(errs[r][0])
                continue
            m = torch.nn.Linear(D_IN, D_OUT)
            with torch.no_grad():
                for p, v in zip(m.parameters(), locs[i], strict=True):
                    p.copy_(v)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(H_IN):
                opt.zero_grad()
                m(_data(i)).pow(2).mean().backward()
                opt.step()
            locs[i] = [p.detach().clone() for p in m.parameters()]
            exact = torch.cat([(g.detach() - p).reshape(-1) for g, p in zip(glob, locs[i], strict=True)])
            exact = exact + residual[i]
            sent = rnd(exact)
            if compress == "int4":  # error feedback: the rounding left out is sent with the next round
                residual[i] = exact - sent
            errs[r].append(float((sent - exact).norm() / exact.norm()) if compress != "none" else 0.0)
            pseudo.append(sent)
        total = pseudo[0].clone()
        for v in pseudo[1:]:
            total.add_(v)
        want = total.div_(n) + mean_residual
        mean = rnd(want)
        if compress == "int4":  # the mean's own rounding: its slice's writer adds it to that slice's next mean
            mean_residual = want - mean
        off = 0
        for g in glob:
            g.grad = mean[off : off + g.numel()].view_as(g).clone()
            off += g.numel()
        outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for i in range(n):
                locs[i] = [torch.lerp(g.detach(), loc, alpha) for g, loc in zip(glob, locs[i], strict=True)]
        states.append([g.detach().clone() for g in glob])
    return states, locs, errs


@pytest.mark.parametrize(
    ("n", "compress", "alpha", "state_every"),
    [(2, "none", 0.0, 1), (3, "bf16", 0.5, 2), (2, "int4", 0.0, 1), (1, "none", 0.0, 1)],
    ids=["2-none", "3-bf16-mix", "2-int4", "1-none"],
)
def test_the_callback_equals_diloco_written_out(tmp_path, n, compress, alpha, state_every):
    import json

    from composer_plugins.diloco.common import param_digest

    rounds = 3
    reps = _run_replicas(
        f"file://{tmp_path}/ref",
        n,
        rounds,
        compress=compress,
        fragment_update_alpha=alpha,
        state_every=state_every,
        keep_rounds=0,
        sync_log=str(tmp_path / "sync.jsonl"),
    )
    states, locs, errs = _reference(n, rounds, compress, alpha)
    logged = [json.loads(line) for line in (tmp_path / "sync.jsonl").read_text().splitlines()]
    assert len(logged) == n * rounds
    for i, (cb, model) in enumerate(reps):
        assert cb.round == rounds
        assert [r["outer_step"] for r in cb.history] == list(range(1, rounds + 1))
        for r, rec in enumerate(cb.history):
            assert rec["compress_error"] == pytest.approx(errs[r][i], rel=1e-4, abs=1e-12)
        assert (errs[-1][i] > 0) == (compress != "none")
        # the bytes each record counts are the store's since the record before, each counted once (what attach
        # wrote or read before the first round, run.json and the probe, a few hundred bytes, is in no record)
        for key in ("bytes_written", "bytes_read"):
            counted, total = sum(r[key] for r in cb.history), getattr(cb.store, key)
            alone = n == 1 and key == "bytes_read"  # one replica reads nothing of a round: its own mean is in memory
            assert alone or all(r[key] > 0 for r in cb.history), (key, [r[key] for r in cb.history])
            assert total - 1024 < counted <= total or (alone and counted == 0), (key, counted, total)
        mine = [r for r in logged if r["replica"] == i]
        assert [r["round"] for r in mine] == list(range(rounds))
        assert mine[-1]["param_hash"] == param_digest(model.parameters())[0]
        for got, want in zip(cb.global_params, states[-1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for got, want in zip(model.parameters(), locs[i], strict=True):
            torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)
        assert [r["round"] for r in cb.history] == list(range(rounds))
        assert all(r["committed"] and r["participants"] == n for r in cb.history)
    rs = reps[0][0].rounds
    # the states written: every state_every rounds and the last, each the global weights after its round
    due = [r for r in range(rounds) if r % state_every == state_every - 1 or r == rounds - 1]
    assert sorted(rs.state_rounds()) == due
    for r in due:
        st = rs.get_state(f"state/{r:08d}")
        assert st["round"] == r + 1
        for got, want in zip(st["global_params"], states[r], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # every round closed with everyone, its mean stored in one slice per replica
    for r in range(rounds):
        m = rs.manifest(r)
        assert m["participants"] == list(range(n)) and m["slices"] == n
        assert all(rs.get_mean(r, j, hi - lo) is not None for j, (lo, hi) in enumerate(slice_bounds(21, n)))


def test_overlap_takes_replica_0s_model_at_round_0_and_ends_equal(tmp_path):
    from composer_plugins.diloco.common import param_digest

    n, rounds = 2, 3
    reps = _run_replicas(f"file://{tmp_path}/ov", n, rounds, overlap=1, keep_rounds=0)
    assert len({param_digest(model.parameters())[0] for _, model in reps}) == 1
    assert all(cb.round == rounds for cb, _ in reps)
    rs = reps[0][0].rounds
    m = rs.manifest(0)
    numel = D_IN * D_OUT + D_OUT
    g0, g1 = (rs.read_grad(0, m["grads"][str(i)], numel) for i in range(n))
    # init_sync: replica 1 synced to replica 0's model before its first pseudo-gradient, so both are the same
    assert torch.equal(g0, g1) and g0.abs().sum() > 0
    m1 = rs.manifest(1)
    h0, h1 = (rs.read_grad(1, m1["grads"][str(i)], numel) for i in range(n))
    assert not torch.equal(h0, h1)  # from round 1 on each replica trains on its own data


# -- a replica joining a run: its settings checked against run.json, catching up from a saved state -------------
def _attach(url: str, seed: int = 0, lr: float = 0.1, index: int = 0, n: int = 1, run_id: str = "ref", **cfg):
    from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
    from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback

    torch.manual_seed(seed)
    model = torch.nn.Linear(D_IN, cfg.pop("d_out", D_OUT))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    base = {"sync_every": H_IN, "outer_steps": 5, "round_timeout_s": 60.0, "poll_s": 0.01}
    config = DiLoCoConfig(transport="object_store", store=url, run_id=run_id, **{**base, **cfg})
    cb = ObjectStoreDiLoCoCallback(config, ReplicaInfo(index=index, num_replicas=n, run_id=run_id))
    return cb.attach(model, opt), model


def test_a_replica_with_other_settings_is_refused_naming_each_difference(tmp_path):
    from composer_plugins.core.errors import ConfigError

    url = f"file://{tmp_path}/run"
    first, _ = _attach(url)
    first.close()
    again, _ = _attach(url)  # the same settings: it joins
    again.close()
    with pytest.raises(ConfigError, match=r"outer_optimizer\.lr is 0\.7 in the run, 0\.3 here") as e:
        _attach(url, outer_lr=0.3)
    assert "diloco.outer_lr" in str(e.value) and "run.json" in str(e.value)
    with pytest.raises(ConfigError, match=r"inner_optimizer\.lr is 0\.1 in the run, 0\.05 here") as e:
        _attach(url, lr=0.05)
    assert "the training config's optimizer" in str(e.value)
    with pytest.raises(ConfigError, match=r"sync_every is 2 in the run, 3 here") as e:
        _attach(url, sync_every=3)
    assert "diloco.sync_every" in str(e.value) and "diloco.outer_lr" not in str(e.value)
    with pytest.raises(ConfigError, match=r"holds another run \(run_id: 'ref' there, 'other' here\)") as e:
        _attach(url, run_id="other")
    assert "pass --run-id ref" in str(e.value)
    with pytest.raises(ConfigError, match=r"another model \(parameter shapes differ\)") as e:
        _attach(url, d_out=4)
    assert "--run-id" not in str(e.value)
    pinned = f"file://{tmp_path}/pinned"  # a run with replay points pins state_every and exact_every
    _attach(pinned, state_every=2, exact_every=3)[0].close()
    with pytest.raises(ConfigError, match=r"exact_every is 3 in the run, 2 here") as e:
        _attach(pinned, state_every=2, exact_every=2)
    assert str(e.value).count("exact_every is") == 1 and "state_every is" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"state_every is 2 in the run, None here; exact_every is 3 in the run"):
        _attach(pinned, state_every=2)  # no replay points here: still held to the run's


def test_a_replica_catches_up_from_the_newest_intact_state(tmp_path, caplog):
    url = f"file://{tmp_path}/ref"
    ((cb, _),) = _run_replicas(url, 1, 3, state_every=1, keep_rounds=0)
    final = [p.detach().clone() for p in cb.global_params]
    momentum = [cb.outer_optimizers[0].state[p]["momentum_buffer"].clone() for p in cb.global_params]
    late, m2 = _attach(url, seed=5, sync_every=H_IN, outer_steps=3)
    assert late.round == 3 and late._done  # the run's 3 rounds are done: nothing left to train
    for g, p, want, buf in zip(late.global_params, m2.parameters(), final, momentum, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=0)
        torch.testing.assert_close(late.outer_optimizers[0].state[g]["momentum_buffer"], buf, rtol=0, atol=0)
    late.close()
    # the newest state damaged: the one before it is taken, and the round after it replayed from its mean
    newest = tmp_path / "ref" / "state" / f"{2:08d}"
    assert newest.exists()
    newest.write_bytes(newest.read_bytes()[:-7])
    with caplog.at_level(logging.INFO, logger=LOG):
        again, m3 = _attach(url, seed=6, outer_steps=5)
    assert any("starts from" in m and m.endswith("state/00000001") for m in caplog.messages), caplog.messages
    assert again.round == 3 and not again._done
    for g, p, want in zip(again.global_params, m3.parameters(), final, strict=True):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    again.close()


def test_overlap_applies_each_round_one_round_late_keeping_the_inner_steps_since(tmp_path):
    """One replica, ``overlap: 1``, written out: at round r's sync the model is snapshot (``s_r``) and the outer
    step runs in the background; at round r+1's sync the model becomes ``p + (g_{r+1} - s_r)``; the last round
    runs in the foreground and ends on the global weights."""
    rounds = 3
    ((cb, model),) = _run_replicas(f"file://{tmp_path}/ov1", 1, rounds, overlap=1, keep_rounds=0)
    torch.manual_seed(0)
    m = torch.nn.Linear(D_IN, D_OUT)
    glob = [p.detach().clone().requires_grad_() for p in m.parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def outer_step(pseudo: list[torch.Tensor]) -> None:
        for g, d in zip(glob, pseudo, strict=True):
            g.grad = d.clone()
        outer.step()
        outer.zero_grad()

    snap = None
    for r in range(rounds):
        for _ in range(H_IN):
            opt.zero_grad()
            m(_data(0)).pow(2).mean().backward()
            opt.step()
        with torch.no_grad():
            if snap is not None:  # the previous round, applied one round late
                for p, g, s in zip(m.parameters(), snap[1], snap[0], strict=True):
                    p.add_(g - s)
            s_r = [p.detach().clone() for p in m.parameters()]
            outer_step([g.detach() - s for g, s in zip(glob, s_r, strict=True)])
            if r < rounds - 1:
                snap = (s_r, [g.detach().clone() for g in glob])
            else:  # the last round in the foreground: the model takes the global weights
                for p, g in zip(m.parameters(), glob, strict=True):
                    p.copy_(g)
    for got, want in zip(cb.global_params, glob, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    for got, want in zip(model.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)


def test_a_prefix_holding_another_runs_objects_is_refused_and_not_claimed(tmp_path):
    from composer_plugins.diloco.objstore import ForeignObjectError

    url = f"file://{tmp_path}/old"
    _run_replicas(url, 1, 2, state_every=1, keep_rounds=0)  # run "ref": states 0 and 1
    (tmp_path / "old" / "run.json").unlink()  # a lifecycle rule deleted the oldest object first
    with pytest.raises(ForeignObjectError, match=r"state/00000001 \(the prefix has no run.json.*belongs to run 'ref'"):
        _attach(url, run_id="fresh")
    assert not (tmp_path / "old" / "run.json").exists()  # taken back: the prefix is not claimed
    # the same run, its run.json lost: it continues from its own newest state
    again, _ = _attach(url, outer_steps=4)
    assert again.round == 2 and (tmp_path / "old" / "run.json").exists()
    again.close()
    # an object of another run read later is refused by name, whichever reader reads it
    other = RoundStore(ObjectStore(url), run_id="fresh")
    with pytest.raises(ForeignObjectError, match=r"state/00000001 belongs to run 'ref', not to this run \('fresh'\)"):
        other.get_state("state/00000001")
    with pytest.raises(StoreObjectError, match="manifest.json belongs to run 'ref'.*cannot be replaced"):
        other.manifest(0)  # a manifest cannot be replaced: the replica stops, naming it
    assert RoundStore(ObjectStore(url), run_id="ref").manifest(0)["participants"] == [0]
