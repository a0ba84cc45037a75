"""Bytecode kept for installs that keep none (nsa_validate.pycache): a fake ``torch`` package without
``.pyc`` files stands in for such an install, in a process of its own."""
import json
import os
import subprocess
import sys

import pytest

from nsa_validate.paths import REPO_ROOT

PROBE = """
import json, os, sys
from nsa_validate import pycache
st = pycache.enable()
import torch                      # the fake one: compiled now, its bytecode written where Python keeps it
print(json.dumps({"state": st, "env": os.environ.get("PYTHONPYCACHEPREFIX"),
                  "dont_write": os.environ.get("PYTHONDONTWRITEBYTECODE"), "flag": sys.dont_write_bytecode}))
"""


def _run(tmp_path, *, pyc_beside: bool = False, user_prefix: str | None = None, cache: str | None = None) -> dict:
    pkg = tmp_path / "site-packages" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    if pyc_beside:
        import py_compile
        py_compile.compile(str(pkg / "__init__.py"), cfile=str(pkg / "__pycache__" /
                                                               f"__init__.{sys.implementation.cache_tag}.pyc"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site-packages"), str(REPO_ROOT)]), PYTHONDONTWRITEBYTECODE="1",
               XDG_CACHE_HOME=cache or str(tmp_path / "cache"))
    if user_prefix:
        env["PYTHONPYCACHEPREFIX"] = user_prefix
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_bytecode_beside_torch_keeps_it_in_the_cache_folder(tmp_path):
    """PYTHONDONTWRITEBYTECODE set and no pyc beside torch: bytecode is written under the cache folder,
    for this process and (through the environment) its children; nothing beside the sources."""
    got = _run(tmp_path)
    prefix = str(tmp_path / "cache" / "nsa-validate" / "pycache")
    assert got["state"]["prefix"] == prefix and got["env"] == prefix
    assert got["dont_write"] is None and got["flag"] is False
    written = sorted(p.name.split(".")[0] for p in (tmp_path / "cache").rglob("*.pyc")
                     if "site-packages/torch/" in str(p))
    assert written == ["__init__"], written
    assert not (tmp_path / "site-packages" / "torch" / "__pycache__").exists()


@pytest.mark.parametrize("case", ["pyc-beside-torch", "user-prefix"])
def test_an_install_with_bytecode_or_a_users_prefix_is_left_alone(tmp_path, case):
    """torch with its bytecode: nothing changes (PYTHONDONTWRITEBYTECODE stays); a prefix the user set: kept."""
    if case == "pyc-beside-torch":
        got = _run(tmp_path, pyc_beside=True)
        assert got["state"]["prefix"] is None and got["env"] is None and got["dont_write"] == "1"
    else:
        mine = str(tmp_path / "mine")
        got = _run(tmp_path, user_prefix=mine)
        assert got["state"]["prefix"] == mine and got["env"] == mine
    assert not (tmp_path / "cache").exists()


def test_a_cache_folder_that_cannot_be_written_is_not_used(tmp_path):
    """Bytecode that cannot be written would be compiled again by every process, the prefix hiding the
    bytecode beside the other packages too: where the folder cannot be made, nothing changes."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    got = _run(tmp_path, cache=str(blocker))                 # the folder would be inside a regular file
    assert got["state"]["prefix"] is None and "cannot be written" in got["state"]["why"]
    assert got["env"] is None and got["dont_write"] == "1"
