"""MindIE Motor's coordinator: a program of its own in front of the server instances.

An asyncio HTTP process without torch (``python -m coordinator``, the ``mindie-coordinator``
console script): the predict port relays requests and streams to the instances it routes them to
(``relay``, ``router``, ``upstream``, ``breaker``, ``pd_pairing`` for prefill/decode pairs), the
manage port registers and polls instances (``manage``, ``registry``) and serves aggregated metrics
(``metrics``). ``fleet/`` is the local fleet launcher behind ``scripts/motor.sh`` and the
Kubernetes discovery sidecar. It speaks to instances only over HTTP and imports only the contract
(``mindie.contract``), the runtime (``mindie.runtime``) and the configuration (``mindie.config``)
of the server's package, never its request stack (tests/test_boundary.py): each API family's
error shapes and the PD protocol are the contract's (``mindie.contract.families``, ``.pd``).
"""
