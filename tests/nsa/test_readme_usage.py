"""README's "Using the layer" example, run as written (on the CPU: the tiny config, torch routes),
so that the example users copy cannot go stale."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("## Using the layer", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"README's 'Using the layer' should hold one python block, found {len(blocks)}"
    return blocks[0]


def test_readme_usage_example_runs(capsys):
    scope: dict = {}
    exec(compile(_example(), str(README), "exec"), scope)
    out, info = scope["out"], scope["info"]
    cfg = scope["cfg"]
    assert scope["y"].shape == scope["x"].shape and out.shape == (1, 1, cfg.d_model)
    assert scope["cache"].length == scope["x"].shape[1] + 1, "the decode step did not append its token"
    assert set(info.reads) == {"cmp", "sel", "win"}
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("sel ") for line in printed), printed
