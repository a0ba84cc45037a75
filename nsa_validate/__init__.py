"""nsa-validate: CLI, environment/pairing check, suite runner, timing, artifacts, report."""
__version__ = "0.1.0"
