"""DiLoCo whose outer sync travels through an object store (``diloco.transport: object_store``).

Replicas never talk to each other: the store (``diloco.store``, an S3/GCS/Azure prefix or ``file://``) is
their only meeting point, so they can run as serverless jobs in places that cannot open ports to each
other. Layout of the run directory::

    run.json                          who the run is: run id, replicas, parameter shapes and every setting the
                                      replicas must share (H, codec, outer and inner optimizer); a second run,
                                      or a replica with other settings, is refused naming what differs
    init                              replica 0's state at the first sync (``init_sync``: everyone starts from it)
    rounds/<r>/grad-<i>-<k>.s<j>      slice j of replica i's pseudo-gradient for round r (codec + SHA-256)
    rounds/<r>/grad-<i>-<k>           its index (slice bounds and checksums), created after the slices
    rounds/<r>/manifest.json          the participants of round r, created once (If-None-Match)
    rounds/<r>/mean-<j>               slice j of round r's mean pseudo-gradient (the run's codec), created once
    state/<r>                         the global weights and outer optimizer state after round r, exact fp32; with
                                      ``exact_every`` > 1 one due state in that many (the rounds between are
                                      rebuilt from their kept means; its hash: :mod:`.statehash`)

Every object but the pseudo-gradient slices (which their index's checksums name) carries the run id; an object of
another run is refused with an error naming it, and a run never starts on a prefix that holds another run's
objects, whether or not that run's ``run.json`` is still there.

A round, on every replica: write the pseudo-gradient (``global - local``, encoded with ``diloco.compress``);
wait until every replica's is there or ``diloco.round_timeout_s`` has passed; then the first replica to try
creates the round manifest, listing the pseudo-gradients whose index it read intact (a torn or corrupt one
fails its checksum and counts as missing). The create is conditional, so there is exactly one manifest per
round. The round's mean is then made slice by slice (a reduce-scatter through the store): participant
``participants[j % P]`` reads slice ``j`` of the others' pseudo-gradients, averages them with its own in
index order and creates ``mean-<j>`` (anyone creates a slice its owner has not written in time); every replica
applies the stored mean (identical bits whoever wrote it), so it reads about ``2 (N-1)/N`` compressed
pseudo-gradients per round, never its own, and takes the same outer step
(:func:`~composer_plugins.diloco.common.build_outer_optimizer`, the torchft path's optimizer; the same
restore / ``grad`` / ``step`` / ``lerp`` sequence as ``torchft.local_sgd``). The replica that created the
manifest writes the new global state. With ``diloco.overlap: 1`` the close, the mean and the outer step
(on the global weights) of round ``r`` run in a background thread during round ``r + 1``'s inner steps, and
the model takes their result one round late (:meth:`ObjectStoreDiLoCoCallback._finish_overlapped`).

Faults: a replica that missed the deadline (the manifest exists without it) drops its local steps and
loads the newest global state; a replica the launcher restarted loads it before training and reports
``"healed": true`` at its first sync; store errors are retried with bounded backoff
(:class:`~composer_plugins.diloco.store.ObjectStore`). With ``init_sync`` (default) the first round
reproduces torchft's: every replica takes replica 0's model and inner-optimizer state at the first sync,
so without faults an ``object_store`` run equals a ``torchft`` run of the same config and seeds.

The sync log has the torchft path's fields (``outer_step``, ``committed``, ``participants``, ``healed``,
``param_hash`` ...) plus ``transport``, ``bytes_written``, ``bytes_read``, ``compress_error``,
``sync_seconds`` and ``store_retries`` (store requests retried during the sync).
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
