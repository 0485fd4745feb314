"""pytest plug-in (entry point ``pytest11``): options for certifying a backend with fp8ref."""


def pytest_addoption(parser):
    group = parser.getgroup("fp8ref")
    group.addoption("--fp8ref-backend", action="append", default=None,
                    help="certify this backend (repeatable); default: every available backend")
