# Without a GPU, Triton kernels run under Triton's interpreter (nsa_validate.interpret decides);
# the switch is set before any test module imports the kernels, which then register their
# backends with nsa_core.routing.
import pytest

from nsa_validate import interpret

interpret.set_for_this_process()

import kernels  # noqa: E402,F401  (registers the Triton and FA-2 backends)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th selected case from the I-th (0-based): `make test` runs N such "
                          "processes at once on a CPU machine (tests/parallel.py)")


@pytest.hookimpl(trylast=True)           # after -k and -m have deselected theirs
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if not shard:
        return
    i, n = (int(v) for v in shard.split("/"))
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard {shard}: want I/N with 0 <= I < N")
    # round robin in collection order: a module's cases, slow and quick alike, spread over the shards
    keep = [it for k, it in enumerate(items) if k % n == i]
    config.hook.pytest_deselected(items=[it for k, it in enumerate(items) if k % n != i])
    items[:] = keep
