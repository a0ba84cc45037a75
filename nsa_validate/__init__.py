"""nsa-validate: the harness (its parts, bottom up: env, measure, bench, report, config, suite, run; the CLI on top)."""
__version__ = "0.1.0"
