"""Test helpers (stand-ins, torchrun workers) live in tests/support/: importable from every test."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))
