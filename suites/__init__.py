"""The validation suites: pytest modules, each run in its own process by the harness
(``nsa_validate.config.registry`` lists them). Shared helpers beside them: ``varlen``, ``read_effect``."""
