"""mindie-bench: load generator for the native, OpenAI and TGI streaming APIs.

Modules: ``workload`` (request specs), ``adapters`` (HTTP client and one adapter per
API), ``stats`` (metric definitions), ``runner`` (load shapes, reports, plots),
``compare`` (A/B alternation) and ``cli`` (the ``mindie-bench`` console script).
"""

__all__ = ["adapters", "cli", "compare", "runner", "stats", "workload"]
