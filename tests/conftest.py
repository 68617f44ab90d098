"""Shared test set-up: make the helpers next to the tests (``xfer_peer``) importable in any
pytest import mode."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
