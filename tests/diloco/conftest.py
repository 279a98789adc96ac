"""Fixtures of the DiLoCo tests: moto's S3 server (loopback, started and stopped here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def moto() -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 (free port) with a bucket ``runs``; the AWS variables that reach it."""
    pytest.importorskip("moto")
    from serverless_support import moto_s3

    with moto_s3() as env:
        yield env
