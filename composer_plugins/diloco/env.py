"""The replica environment contract: the variables a launcher or executor sets and a replica reads
(:class:`~composer_plugins.diloco.common.ReplicaInfo` turns them into its identity). Import-light: no torch.
"""

from __future__ import annotations

ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
ENV_INDEX = "COMPOSER_DILOCO_REPLICA_INDEX"
ENV_NUM = "COMPOSER_DILOCO_NUM_REPLICAS"
ENV_REPLICA_ID = "COMPOSER_DILOCO_REPLICA_ID"
ENV_RESTART = "COMPOSER_DILOCO_RESTART"
ENV_SEED = "COMPOSER_DILOCO_SEED"
ENV_BARRIER = "COMPOSER_DILOCO_BARRIER"
ENV_BARRIER_SIZE = "COMPOSER_DILOCO_BARRIER_SIZE"
ENV_STOP_FILE = "COMPOSER_DILOCO_STOP_FILE"
ENV_SYNC_LOG = "COMPOSER_DILOCO_SYNC_LOG"
ENV_REJOIN = "COMPOSER_DILOCO_REJOIN"
ENV_STORE = "COMPOSER_DILOCO_STORE"
ENV_RUN_ID = "COMPOSER_DILOCO_RUN_ID"

#: what a launcher sets for a replica (and clears from its own environment first)
REPLICA_VARS = (
    ENV_INDEX,
    ENV_NUM,
    ENV_REPLICA_ID,
    ENV_RESTART,
    ENV_SEED,
    ENV_BARRIER,
    ENV_BARRIER_SIZE,
    ENV_STOP_FILE,
    ENV_SYNC_LOG,
    ENV_REJOIN,
    ENV_STORE,
    ENV_RUN_ID,
    ENV_LIGHTHOUSE,
)

LOOPBACK = "127.0.0.1"
