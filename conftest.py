# Without a GPU, Triton kernels run under Triton's interpreter (as the CLI's suite processes do,
# see nsa_validate.runner.suite_env). Triton reads TRITON_INTERPRET when a kernel is defined, so it
# is set here, before any test module imports the kernels.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
