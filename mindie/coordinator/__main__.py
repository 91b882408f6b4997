"""``python -m mindie.coordinator --config ms_coordinator.json``: see mindie/coordinator/cli.py."""
import sys

from mindie.coordinator.cli import main

sys.exit(main())
