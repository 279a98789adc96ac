"""DiLoCo across replicas: the Lightning callbacks of its outer-sync transports (``strategy``: torchft;
``objstore/``: through an object store), transports, pseudo-gradient codecs and replica executors as plugin kinds
(``transports``, ``codecs``, ``executors``), what both share (``common``: config sections, outer optimizer), the
replica launcher (``launch``) with its executor seam (``executor``, ``executors``, ``forkserver``) and meeting
points (``coordination``), the replica entry point (``run``, ``replica``) and the toy LM (``toy``).

Imports point down: ``core``, ``procs`` and ``training`` only.
"""
