# Without a GPU, Triton kernels run under Triton's interpreter (nsa_validate.interpret decides);
# the switch is set before any test module imports the kernels, which then register their
# backends with nsa_core.routing.
from nsa_validate import interpret

interpret.set_for_this_process()

import kernels  # noqa: E402,F401  (registers the Triton and FA-2 backends)
