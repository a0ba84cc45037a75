"""``nsa-validate`` and ``python -m nsa_validate``: stop signals are caught first, then the CLI is imported."""


def main() -> None:
    from nsa_validate import startup
    startup.catch_early()
    from nsa_validate import pycache
    pycache.enable()                      # before torch is imported: its bytecode, where it keeps none
    from nsa_validate.cli import main as cli_main
    cli_main()


if __name__ == "__main__":
    main()
