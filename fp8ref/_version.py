"""fp8ref's version, at the ground floor so that any room can read it without importing the package's
face (which imports everything; pyproject.toml's ``version`` must match, tests/test_layout.py checks)."""

__version__ = "0.1.0"
