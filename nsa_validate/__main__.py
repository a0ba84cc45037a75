"""``nsa-validate`` and ``python -m nsa_validate``: stop signals are caught first, then the CLI is imported."""
import os
import sys


def main() -> None:
    from nsa_validate import startup
    startup.catch_early()
    from nsa_validate import pycache
    pycache.enable()                      # before torch is imported: its bytecode, where it keeps none
    from nsa_validate.cli import main as cli_main
    try:
        cli_main()
    except SystemExit as e:
        _leave(e.code)
        raise


def _leave(code) -> None:
    """Where the command imported torch (a run, ``env``), end the process here, without Python's shutdown:
    tearing torch (and a CUDA context) down took ~1 s after every run, with nothing left to do. Every file
    is written and closed by then (atomically, ``safefs``), threads that write are joined, and the suite
    processes leave the same way (``suite/plugin.py``). Elsewhere (no torch) a normal exit."""
    if "torch" not in sys.modules:
        return
    if code is None:
        code = 0
    elif not isinstance(code, int):       # sys.exit("message"): Python prints it and exits with 1
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):     # a closed pipe (`| tee` killed by the same Ctrl-C): the run is kept
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
