"""Store URLs: which ones the storage libraries open, and how they appear in logs (import-light: no torch).

A URL whose scheme obstore reaches (:data:`SCHEMES`) is opened with obstore, any other scheme fsspec has a
filesystem for with fsspec. Nothing else keeps a list of schemes.
"""

from __future__ import annotations

from collections.abc import Callable

from composer_plugins.core.config import redact_url
from composer_plugins.core.errors import closest

__all__ = ["SCHEMES", "check_store_url", "fsspec_protocols", "redact_url"]

#: URL schemes obstore's ``from_url`` reaches.
SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "adl", "azure", "file", "memory", "http", "https")


def fsspec_protocols() -> list[str]:
    """The schemes fsspec has a filesystem for, known or registered at run time (none without fsspec)."""
    try:
        import fsspec
    except ImportError:
        return []
    return sorted({*fsspec.available_protocols(), *fsspec.registry})


def check_store_url(url: str, error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` unless ``url`` is a store URL obstore or fsspec can open."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest.strip("/"):
        raise error(
            f"{redact_url(url)!r} is not a store URL. HINT: s3://bucket/prefix, gs://bucket/prefix, az://container/"
            "prefix or file:///absolute/path."
        )
    if scheme not in SCHEMES and scheme not in fsspec_protocols():
        near = closest(scheme, [*SCHEMES, *fsspec_protocols()], cutoff=0.4)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise error(
            f"unknown store scheme {scheme!r} in {redact_url(url)!r}; available: {', '.join(SCHEMES)} (obstore) or a "
            f"protocol registered with fsspec (fsspec.available_protocols()).{hint}"
        )
    if scheme == "file" and not rest.startswith("/"):
        raise error(f"{redact_url(url)!r}: a file store needs an absolute path (file:///abs/path).")
    if scheme.startswith("s3") and len(rest.split("/", 1)[0]) < 3:
        raise error(f"{redact_url(url)!r}: S3 bucket names have at least 3 characters.")
