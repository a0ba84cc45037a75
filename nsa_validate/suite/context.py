"""What a suite process is told about its run: typed, written to a file, recorded in the run.

The CLI writes a ``RunContext`` to ``<run>/suites/<suite>.context.json`` and starts pytest with
``--nsa-context`` pointing at it. A plain ``pytest suites/`` builds the default context (the
auto-selected profile, the current device), so the CLI and pytest run the same tests.
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from nsa_validate.config import profiles
from nsa_validate.config.profiles import Profile


@dataclass
class RunContext:
    profile: Profile
    device: str                       # "cuda" | "cpu"
    out_dir: str = ""                 # where a suite may write CSVs and plots ("" = don't)
    strict: bool = False
    gpu_index: int | None = None      # `oneshot --gpus`: the local GPU this suite runs on
    parent_pid: int | None = None     # the nsa-validate process: the suite process dies with it
    # the lock file of a GPU other suites run on at the same time (``gpu_share``); None: alone
    gpu_lock: str | None = None
    run_id: str | None = None         # the run folder's id and commit, for CSV columns and plot titles
    commit: str | None = None
    select: str | None = None         # `-k EXPR`: pytest's case selection, passed to every suite
    timeout_s: int | None = None      # `--timeout`: each suite's limit instead of the profile's
    gpu_name: str | None = None       # the GPU's name, as the run saw it (None: ask torch)
    workers: int = 1                  # the suite's pytest processes, taking its cases in turn
    compile_locks: str | None = None  # the run's folder of per-kernel compile locks (``compile_once``)
    launch_log: str | None = None     # the run's kernels.jsonl: the launches that compiled (``launches``)
    warming: str | None = None        # the run's warming processes' lock (``gpu_share.wait_warming``); None: none

    def to_dict(self) -> dict:
        return asdict(self)

    @functools.cached_property
    def device_name(self) -> str | None:
        if self.device != "cuda":
            return None
        if self.gpu_name:
            return self.gpu_name
        import torch
        return torch.cuda.get_device_name(self.gpu_index if self.gpu_index is not None else torch.cuda.current_device())

    @functools.cached_property
    def _expectations(self) -> tuple[profiles.ExpectCfg, str | None]:
        return self.profile.expectations(self.device_name)

    @property
    def expect(self) -> profiles.ExpectCfg:
        """The profile's expectations for this GPU (``Profile.expectations``), looked up once."""
        return self._expectations[0]

    def run_meta(self, **more) -> dict:
        """The columns every CSV of a run starts with, and what plot titles say: run id, GPU,
        commit, level (and ``more``, e.g. the dtype)."""
        return {"run_id": self.run_id, "gpu": self.device_name or "CPU", "commit": self.commit,
                "level": self.profile.level, **more}

    def expect_note(self) -> str:
        """Where the expectations come from, for the report."""
        key = self._expectations[1]
        where = f"the {self.profile.name} family" + (f" with its '{key}' overrides (expect_by_device)" if key else "")
        return f"expectations: {where}, on {self.device_name or 'the CPU'}"

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: Path) -> "RunContext":
        d = json.loads(Path(path).read_text())
        return cls(profile=profiles.from_dict(d.pop("profile")), **d)


def default(level: str = profiles.DEFAULT_LEVEL) -> RunContext:
    prof, device = profiles.resolve(level=level)
    return RunContext(profile=prof, device=device)


_current: RunContext | None = None


def current() -> RunContext:
    global _current
    if _current is None:
        _current = default()
    return _current


def set_current(ctx: RunContext) -> None:
    global _current
    _current = ctx
