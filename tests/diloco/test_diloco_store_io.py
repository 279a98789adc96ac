"""The object store's IO is device- and size-safe: the codecs only ever see plain CPU tensors (parameters
that stand for device memory never reach them), and a 64 MiB object crosses a bandwidth-limited link on
which one whole-object request would exceed the per-request timeout."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from serverless_support import FaultyProxy, store_url
from torch import nn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class OnDevice(torch.Tensor):
    """A tensor that stands for device memory on a CPU-only machine: like a CUDA tensor, it has no numpy view,
    and the store codecs refuse it (they take plain CPU tensors only)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.numpy, torch.Tensor.tolist):
            raise TypeError("can't convert a device tensor to numpy: copy it to the host first")
        return super().__torch_function__(func, types, args, kwargs or {})


def _on_device(model: nn.Module) -> nn.Module:
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(p.detach().clone().as_subclass(OnDevice))
    return model


def test_store_codecs_only_ever_see_host_tensors(tmp_path, monkeypatch):
    from composer_plugins.diloco import objstore
    from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo

    seen: list[tuple[str, type, str]] = []

    def watch(name: str, fn: Any) -> Any:
        def walk(x: Any) -> None:
            if isinstance(x, torch.Tensor):
                seen.append((name, type(x), x.device.type))
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            walk(args)
            out = fn(*args, **kwargs)
            walk(out)
            return out

        return wrapped

    from composer_plugins.diloco.objstore import rounds

    for name in ("encode_vector", "decode_vector", "encode_tree", "decode_tree"):  # every store read and write
        monkeypatch.setattr(rounds, name, watch(name, getattr(rounds, name)))
    url = store_url("file", tmp_path, "device")
    cfg = DiLoCoConfig(transport="object_store", store=url, sync_every=2, outer_steps=3, poll_s=0.01)
    hashes: dict[int, str] = {}
    errors: list[BaseException] = []

    def replica(i: int, restart: int = 0) -> objstore.ObjectStoreDiLoCoCallback:
        torch.manual_seed(i)
        model = _on_device(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
        assert all(type(p.data) is OnDevice for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        cb = objstore.ObjectStoreDiLoCoCallback(
            cfg, ReplicaInfo(index=i, num_replicas=2, run_id="device", restart=restart)
        )
        cb.attach(model, opt)
        g = torch.Generator().manual_seed(100 + i)
        while not cb._stop and cb.inner_steps < 20:
            x = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        cb.close()
        hashes[i] = cb.history[-1]["param_hash"] if cb.history else ""
        return cb

    def run(i: int) -> None:
        try:
            replica(i)
        except BaseException as e:
            errors.append(e)

    cfg.sync_log = str(tmp_path / "sync.jsonl")
    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert hashes[0] == hashes[1]
    # a restart reads init and the states back (decode) onto the device parameters
    again = replica(1, restart=1)
    assert again.heal_count >= 1
    kinds = {n for n, _, _ in seen}
    assert kinds == {"encode_vector", "decode_vector", "encode_tree", "decode_tree"}, kinds
    assert all(t is torch.Tensor and d == "cpu" for _, t, d in seen), {(n, t.__name__, d) for n, t, d in seen}


def test_64_mib_object_crosses_a_slow_link_that_one_whole_request_cannot(moto, monkeypatch, tmp_path):
    """At 12 MiB/s per connection a 64 MiB object takes ~5 s in one request: past a 2 s per-request timeout
    (the old code's single PUT/GET under its total timeout fails the same way at 10 s on a link 5x slower).
    In 8 MiB parts each request takes ~0.7 s, and the object goes up and comes back intact."""
    from composer_plugins.diloco.store import ObjectStore, StoreError

    host, port = moto["AWS_ENDPOINT_URL"].rsplit("//", 1)[1].split(":")
    proxy = FaultyProxy((host, int(port)), rate=12 << 20)
    for k, v in {**moto, "AWS_ENDPOINT_URL": proxy.endpoint}.items():
        monkeypatch.setenv(k, v)
    data = os.urandom(64 << 20)
    url = store_url("s3", tmp_path, "big")
    try:
        store = ObjectStore(url, request_timeout_s=2.0, retry_s=30.0)
        assert store.put("state/00000000", data, create=True)
        assert not store.put("state/00000000", b"other", create=True)  # still one conditional create
        assert store.get("state/00000000") == data
        whole = ObjectStore(url, request_timeout_s=2.0, retry_s=1.0, part_bytes=128 << 20)
        with pytest.raises(StoreError, match="still failing"):
            whole.put("state/00000001", data)
    finally:
        proxy.close()
