"""The run lifecycle, apart from the CLI: ``execute.execute`` a ``RunRequest`` (profile, run folder and
manifest, environment check, suites on their GPUs, signals), then ``finish.finish`` it into results.json,
routing.json, junit.xml and the views. Progress reaches the caller through a ``listener.Listener``; nothing
here prints. ``finish.repair`` finishes a folder whose process vanished.

Nothing is imported here: `nsa-validate --help` and the other light commands load only the modules
they use (the lifecycle pulls in the environment check, the report writers and the process plumbing).
"""
