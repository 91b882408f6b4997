"""``python -m coordinator --config ms_coordinator.json``: see coordinator/cli.py."""
import sys

from coordinator.cli import main

sys.exit(main())
