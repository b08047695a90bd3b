"""qcomm's test suites: a package, so that its conftest is ``tests.conftest`` (beside bench/conftest.py)."""
