"""The run lifecycle, apart from the CLI: ``execute`` a ``RunRequest`` (profile, run folder and
manifest, environment check, suites on their GPUs, signals), then ``finish`` it into results.json,
routing.json, junit.xml and the views. Progress reaches the caller through a ``Listener``; nothing
here prints. ``repair`` finishes a folder whose process vanished.
"""
from nsa_validate.run.execute import Outcome, RunRequest, execute, shard  # noqa: F401
from nsa_validate.run.finish import (finish, load_run, mark_failed, read_manifest, repair, stale,  # noqa: F401
                                     write_views)
from nsa_validate.run.listener import Listener  # noqa: F401
