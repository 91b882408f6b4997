"""``python -m coordinator.fleet`` (what scripts/motor.sh runs): the fleet's command line,
coordinator/fleet/cli.py."""
import sys

from coordinator.fleet.cli import main

try:
    sys.exit(main())
except KeyboardInterrupt:  # Ctrl-C before anything was started (the run has its own handler)
    sys.exit(130)
