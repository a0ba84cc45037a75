# The suites' pytest plugin lives in nsa_validate so the CLI and plain pytest share it.
from nsa_validate.plugin import *  # noqa: F401,F403
from nsa_validate.plugin import (ctx, pytest_addoption, pytest_collection_finish,  # noqa: F401
                                 pytest_configure, pytest_runtest_logfinish,
                                 pytest_runtest_logreport, pytest_sessionstart, record)
