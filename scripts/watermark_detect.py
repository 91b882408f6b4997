#!/usr/bin/env python3
"""Watermark detector: ``python scripts/watermark_detect.py '[ids]' --gamma 0.5`` (or ids on stdin).

Same as the ``mindie-watermark-detect`` console script; works from a source checkout too.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.watermark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
