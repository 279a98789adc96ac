"""DiLoCo whose outer sync travels through an object store (``diloco.transport: object_store``).

The store (``diloco.store``) is the replicas' only meeting point. Layout of the run directory::

    run.json                          the run's identity and every setting its replicas must share
    init                              replica 0's state at the first sync (``init_sync``)
    rounds/<r>/grad-<i>-<k>.s<j>      slice j of replica i's pseudo-gradient for round r (codec + SHA-256)
    rounds/<r>/grad-<i>-<k>           its index (slice bounds and checksums), created after the slices
    rounds/<r>/manifest.json          the participants of round r, created once (If-None-Match)
    rounds/<r>/mean-<j>               slice j of round r's mean pseudo-gradient, created once
    state/<r>                         the global weights and outer optimizer state after round r (exact fp32,
                                      or a replay point: :mod:`.statehash`)

The round, faults, the trust model (each object but a slice carries the run id) and the sync log's extra fields:
docs/diloco.md ("Serverless: replicas that meet through an object store").
"""

from composer_plugins.diloco.objstore.callback import ObjectStoreDiLoCoCallback
from composer_plugins.diloco.objstore.identity import optimizer_settings
from composer_plugins.diloco.objstore.rounds import (
    ForeignObjectError,
    RoundStore,
    StoreObjectError,
    encode_slices,
    slice_bounds,
)

__all__ = [
    "ForeignObjectError",
    "ObjectStoreDiLoCoCallback",
    "RoundStore",
    "StoreObjectError",
    "encode_slices",
    "optimizer_settings",
    "slice_bounds",
]
