# Without a GPU, Triton kernels run under Triton's interpreter (nsa_validate.env.interpret decides);
# the switch is set before any test module imports the kernels, which then register their
# backends with nsa_core.routing.
from nsa_validate.env import interpret

interpret.set_for_this_process()

import kernels  # noqa: E402,F401  (registers the Triton and FA-2 backends)

# cases claimed one at a time by several processes: `--claim-from` (make test, a suite run as several)
pytest_plugins = ["nsa_validate.suite.claim"]


def pytest_addoption(parser):
    parser.addoption("--nsa-level", default=None, choices=("quick", "standard", "full"),
                     help="the profile level a plain `pytest suites/` runs at (default: standard; `make test` on a "
                          "CPU machine runs the full CPU sweep)")
