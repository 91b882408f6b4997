"""The contract between the front ends (``mindie/``) and the device side (``workers/``): what
crosses the process boundary, and nothing else.

- ``wire``: the ZeroMQ messages (msgspec Structs, msgpack) and their timing constants;
- ``errors``: MindIE's error types by HTTP status and the finish reasons;
- ``spec``: what a device worker is told (``WorkerSpec`` with its ``EngineConfig``), the
  launch plan (``Deployment``) and the naming of worker endpoints in the run directory.

Runtime code both sides share (lifecycle, logging, CURVE files, environment overrides, the GC
freeze) is ``mindie.runtime``. The rule (tests/test_boundary.py enforces it): ``workers/`` imports
nothing of ``mindie/`` but these two packages; ``mindie/`` outside them imports nothing of
``workers/``; and they import only the standard library, msgspec and themselves.
"""
