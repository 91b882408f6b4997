"""Runtime code every process of the server shares, front ends and device workers alike (it is
not part of the contract, nothing of it crosses a socket):

- ``lifecycle``: how every process dies with its parent, and the run directory's entries, its
  claim at start and its cleanup at stop;
- ``log_setup``: the log format every process writes (text or JSON, MindIE's LogConfig);
- ``curve``: the security of a worker link (tcp needs CURVE keys or the insecure flag) and the
  CURVE key files;
- ``env``: the environment overrides of config keys (the one table, docs/config.md), parsed once;
- ``gc_freeze``: freezing the start-up heap out of the garbage collector's passes.

Like ``mindie.contract``, it imports only the standard library, msgspec and itself, so both sides
may import it (tests/test_boundary.py).
"""
