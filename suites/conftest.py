# The suites' pytest plugin lives in nsa_validate, so the CLI's suite processes and a plain
# `pytest suites/` load the same hooks and fixtures.
from nsa_validate.suite.plugin import (ctx, extra, pytest_addoption, pytest_collection_finish,  # noqa: F401
                                 pytest_collection_modifyitems,
                                 pytest_configure, pytest_runtest_call, pytest_runtest_logfinish, pytest_runtest_logstart,
                                 pytest_runtest_logreport, pytest_runtest_protocol, pytest_runtest_setup,
                                 pytest_runtest_teardown, pytest_sessionstart,
                                 pytest_unconfigure, quiet, record)
