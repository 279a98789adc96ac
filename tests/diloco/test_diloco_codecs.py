"""Codecs as a plugin kind (issue 42): the built-ins register through ``register_codecs`` and keep the codec
contract (:func:`composer_plugins.testing.conformance.check_codec`); a third-party codec from a separate
distribution (``codec_plugin/``, found through its entry point) is listed with its provider and carries a moto S3
run; a codec that breaks the contract is named by the conformance check."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from serverless_support import HERE, cli, finish, records, result, store_url

from composer_plugins import hookimpl
from composer_plugins.core import plugins
from composer_plugins.diloco.codecs import Codec
from composer_plugins.testing.conformance import ConformanceError, check, check_codec

pytestmark = pytest.mark.timeout(480)
PLUGIN_DIR = HERE / "codec_plugin"
BUILTINS = ("none", "bf16", "int8", "int4", "sparseloco", "sparse")


class _Lenient(Codec):
    """Decodes whatever it is given (a broken codec)."""

    tolerance = 0.01

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        return {}, vec.numpy().tobytes()

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        got = torch.frombuffer(bytearray(body), dtype=torch.float32)[:numel] if len(body) >= 4 else torch.zeros(0)
        return torch.nn.functional.pad(got, (0, numel - got.numel()))


class _Noisy(Codec):
    """Adds fresh noise at every encode (not deterministic)."""

    tolerance = 0.5

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        return {}, (vec + 1e-3 * torch.randn(vec.shape)).numpy().tobytes()

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        if len(body) != 4 * numel:
            raise ValueError(f"{len(body)} bytes for {numel} values")
        return torch.frombuffer(bytearray(body), dtype=torch.float32).clone() if numel else torch.zeros(0)


class _Plugin:
    __name__ = "codec_test_plugin"

    @hookimpl
    def register_codecs(self, register: Any) -> None:
        register("lenient", _Lenient)
        register("noisy", _Noisy)


@pytest.fixture
def with_codecs(isolated_plugins):
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(_Plugin(), name="codec_test_plugin")
    plugins.use_plugin_manager(pm)
    yield pm


def test_hook_register_codecs(with_codecs):
    reg = plugins.get_registry()
    assert set(BUILTINS) | {"lenient", "noisy"} <= set(reg.names("codecs"))
    assert reg.get("codecs", "int4").plugin == "composer_plugins.diloco.plugin"
    assert reg.get("codecs", "lenient").plugin == "codec_test_plugin"
    with pytest.raises(ConformanceError, match=r"codecs 'lenient'.*body decoded without an error"):
        check_codec("lenient")
    with pytest.raises(ConformanceError, match=r"codecs 'noisy'.*different bytes \(not deterministic\)"):
        check("codecs", "noisy")


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_codecs_keep_the_codec_contract(name):
    """Empty slices (a model smaller than its replica count) and bodies with bytes past their end included."""
    check("codecs", name)


@pytest.mark.slow
def test_third_party_codec_is_listed_with_its_provider_and_carries_an_s3_run(moto, tmp_path):
    # this suite turns third-party autoload off (COMPOSER_PLUGINS_LOAD=''); the user's switch loads the one plugin
    env = {
        **moto,
        "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]),
        "COMPOSER_PLUGINS_LOAD": "fp16codec",
    }
    listed = subprocess.run(
        [sys.executable, "-m", "composer_plugins", "list", "codecs"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    row = next(ln for ln in listed.stdout.splitlines() if ln.startswith("fp16 "))
    assert "codecs" in row and "composer-plugins-fp16codec 0.1.0" in row, listed.stdout
    url = store_url("s3", tmp_path, "fp16")
    log_dir = tmp_path / "logs"
    proc = cli(
        tmp_path,
        "logs",
        "toy.max_steps=16",
        "-S",
        "diloco.transport=object_store",
        "-S",
        f"diloco.store={url}",
        "-S",
        "diloco.compress=fp16",
        env=env,
    )
    finish(proc, log_dir)
    a, b = result(log_dir, 0), result(log_dir, 1)
    assert a["param_hash"] == b["param_hash"] and a["outer_step"] == 2
    r0 = records(log_dir, 0)
    assert all(r["participants"] == 2 and r["committed"] for r in r0), r0
    assert 0 < r0[0]["compress_error"] < 1e-3
    import boto3

    from composer_plugins.diloco.store import unpack

    s3 = boto3.client(
        "s3",
        endpoint_url=moto["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    prefix = url.removeprefix("s3://runs/")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="runs", Prefix=f"{prefix}/rounds/").get("Contents", [])]
    slices = [k for k in keys if ".s0" in k.rsplit("/", 1)[1]]
    assert slices, keys
    header, body = unpack(s3.get_object(Bucket="runs", Key=slices[0])["Body"].read())
    assert header["codec"] == "fp16" and header["scale"] == 1.0 and len(body) == 2 * header["numel"]
    # without the plugin, a replica cannot even start on that codec: refused before anything runs
    bare = cli(
        tmp_path,
        "bare",
        "toy.max_steps=16",
        "-S",
        "diloco.transport=object_store",
        "-S",
        f"diloco.store={store_url('s3', tmp_path, 'bare')}",
        "-S",
        "diloco.compress=fp16",
        env=moto,
    )
    out = finish(bare, tmp_path / "bare", rc=2)
    assert "diloco.compress" in out and "Unknown codec 'fp16'" in out and "list codecs" in out, out


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 0.6, 0.9, 1.0])
def test_sparse_codec_writes_whichever_form_is_smaller_per_vector(density):
    """``sparse`` (a sparse codec's mean codec) picks, for each vector it encodes, the sparse form (bitmap and
    values) when that is smaller than dense fp16 and the dense form otherwise; both decode to the same values."""
    import zlib

    import numpy as np

    from composer_plugins.diloco.codecs import get_codec

    n = 20_000
    g = torch.Generator().manual_seed(int(density * 100))
    vec = torch.randn(n, generator=g) * (torch.rand(n, generator=g) < density)
    codec = get_codec("sparse")
    header, body = codec.encode(vec)
    nnz = int((vec != 0).sum())
    sparse_size = len(zlib.compress(np.packbits((vec != 0).numpy()).tobytes(), 6)) + 2 * nnz
    assert len(body) == min(sparse_size, 2 * n)
    assert header["form"] == ("sparse" if sparse_size < 2 * n else "dense")
    out = codec.decode(header, body, n)
    assert bool((out[vec == 0] == 0).all())
    torch.testing.assert_close(out, vec, atol=1e-3 * float(vec.abs().max().clamp_min(1e-30)), rtol=1e-3)
