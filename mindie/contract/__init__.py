"""The contract between the front ends (``mindie/``) and the device side (``workers/``).

Everything both sides must agree on lives here and nowhere else:

- ``wire``: the ZeroMQ messages (msgspec Structs, msgpack) and their timing constants;
- ``errors``: MindIE's error types by HTTP status and the finish reasons;
- ``spec``: what a device worker is told (``WorkerSpec`` with its ``EngineConfig``), the
  launch plan (``Deployment``) and the naming of worker endpoints in the run directory;
- ``lifecycle``: how every process dies with its parent, and the run directory's entries, its
  claim at start and its cleanup at stop;
- ``curve``: the security of a worker link (tcp needs CURVE keys or the insecure flag) and the
  CURVE key files.

The rule (tests/test_boundary.py enforces it): ``workers/`` imports nothing of ``mindie/``
but this package; ``mindie/`` outside this package imports nothing of ``workers/``; and this
package imports only the standard library, msgspec and itself.
"""
