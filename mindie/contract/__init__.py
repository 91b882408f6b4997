"""The contract between the processes: what crosses a process boundary, and nothing else.

Between the front ends (``mindie/``) and the device side (``workers/``):

- ``wire``: the ZeroMQ messages (msgspec Structs, msgpack) and their timing constants;
- ``errors``: MindIE's error types by HTTP status and the finish reasons;
- ``spec``: what a device worker is told (``WorkerSpec`` with its ``EngineConfig``), the
  launch plan (``Deployment``) and the naming of worker endpoints in the run directory;
- ``grammar``: the grammar text a structured-output constraint compiles to, its defaults and the
  one ``ConstraintError`` (the front end checks what the worker enforces);
- ``pd``: prefill/decode disaggregation's protocol (roles, the ``X-Mindie-PD`` header, the KV
  endpoints' schemes), shared with the coordinator too.

Between the server and the coordinator (``coordinator/``), on the predict port:

- ``http_error``: ``ApiError``, the one HTTP error type, and MindIE's error body;
- ``families``: which API family a request belongs to (one ``/generate`` rule), and each
  family's error answer, stream-error frame and stream terminator;
- ``sse_framing``: server-sent events as bytes (``event``, ``json_event``, OpenAI's ``DONE``).

Runtime code the sides share (lifecycle, logging, CURVE files, environment overrides, the GC
freeze, TLS) is ``mindie.runtime``. The rule (tests/test_boundary.py enforces it): ``workers/``
imports nothing of ``mindie/`` but these two packages; ``mindie/`` outside them imports nothing of
``workers/``; the coordinator imports only them and ``mindie.config``; and they import only the
standard library, msgspec and themselves (llguidance inside ``grammar.grammar_text`` aside).
"""
