"""Where the repository and the test data are, for test modules at any folder depth."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GOLDEN = TESTS / "golden"
