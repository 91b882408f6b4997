"""``python -m mindie_bench`` runs the ``mindie-bench`` CLI."""
from mindie_bench.cli import main

raise SystemExit(main())
