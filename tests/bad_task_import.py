"""A task file that cannot be imported (for the error-message tests)."""

import a_module_that_does_not_exist  # noqa: F401


def task():
    raise AssertionError("never reached")
