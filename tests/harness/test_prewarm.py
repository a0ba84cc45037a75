"""The launch list a run records (nsa_validate.suite.launches) and the warming processes that compile it
before the suites need it (nsa_validate.run.prewarm)."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from nsa_validate.paths import REPO_ROOT
from nsa_validate.run import prewarm
from nsa_validate.suite import launches
from tests.harness.test_hostile import _alive, _children

GPU = torch.cuda.is_available()


def test_arguments_round_trip_as_triton_specialises_them():
    """A tensor becomes its dtype and 16-byte alignment (what Triton specialises a pointer on), a
    scalar stays itself (its value decides an integer's specialisation), dtypes and tuples keep their
    kind; what comes back has the dtype and an address of the same alignment."""
    base = torch.zeros(64, dtype=torch.float16)
    odd = base[1:]                                       # 2 bytes past an aligned address
    for t, aligned in ((base, True), (odd, False)):
        enc = launches._encode(t)
        assert enc == {"tensor": "float16", "aligned": aligned}
        back = launches._decode(json.loads(json.dumps(enc)))
        assert back.dtype == torch.float16 and (back.data_ptr() % 16 == 0) == aligned
    for v in (None, True, 7, 16, 1, 0.5, "x"):
        assert launches._decode(json.loads(json.dumps(launches._encode(v)))) == v
    assert launches._decode(launches._encode(torch.bfloat16)) is torch.bfloat16
    assert launches._decode(json.loads(json.dumps(launches._encode((3, None))))) == (3, None)
    with pytest.raises(launches._Unrecordable):
        launches._encode(object())


def test_a_compile_without_a_launch_records_its_tensors_as_a_launch_would():
    """``JITFunction.warmup`` hands the kernel ``MockTensor``s (a dtype, address 0): recorded as an aligned tensor
    of that dtype, the same line a launch with real tensors writes, so the warming compiles what a kernel asked
    about (``kernels.decode._fits_per_sm``) before it asks."""
    jit = pytest.importorskip("triton.runtime.jit")
    mock = jit.MockTensor.wrap_dtype(torch.bfloat16)
    assert launches._encode(mock) == launches._encode(torch.zeros(8, dtype=torch.bfloat16)) == {
        "tensor": "bfloat16", "aligned": True}
    back = launches._decode(launches._encode(mock))
    assert launches._encode(back) == launches._encode(mock)


def test_a_tensor_descriptor_keeps_its_shape_strides_and_block():
    desc_mod = pytest.importorskip("triton.tools.tensor_descriptor")
    x = torch.zeros(8, 2, 32, dtype=torch.bfloat16)
    enc = json.loads(json.dumps(launches._encode(desc_mod.TensorDescriptor(x, [8, 2, 32], [64, 32, 1], [4, 1, 32]))))
    assert enc["descriptor"] == "bfloat16" and enc["shape"] == [8, 2, 32] and enc["block_shape"] == [4, 1, 32]
    back = launches._decode(enc)
    assert back.base.dtype == torch.bfloat16 and list(back.strides) == [64, 32, 1]


def test_read_keeps_each_launch_once_earliest_first_and_skips_a_cut_line(tmp_path):
    path = tmp_path / "kernels.jsonl"
    a = {"fn": "m:a", "args": [1], "kwargs": {}}
    b = {"fn": "m:b", "args": [{"tensor": "float32", "aligned": True}], "kwargs": {"BLOCK": 64}}
    lines = [{**a, "suite": "decode", "at_s": 9.0}, {**b, "suite": "layer", "at_s": 5.0},
             {**a, "suite": "counters", "at_s": 2.0}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"fn": "m:c", "ar')
    got = launches.read(path)
    assert [(e["fn"], e["at_s"]) for e in got] == [("m:a", 2.0), ("m:b", 5.0)]
    assert launches.read(tmp_path / "missing.jsonl") == []
    other = tmp_path / "run.jsonl"
    other.write_text(json.dumps({**b, "at_s": 1}) + "\n" + json.dumps({"fn": "m:d", "args": [], "kwargs": {}}) + "\n")
    assert prewarm.unlisted(got, other) == 1            # m:d: compiled by the suites, not in the list


def test_a_launch_the_list_names_with_other_unspecialised_integers_is_not_unlisted(tmp_path):
    """The report's count of launches the list lacks is by compile: a stride Triton does not tell apart
    (64 and 128, both multiples of 16) or a descriptor of another shape (a multiple of 16 or not) is the list's
    compile; a stride of another class (65), a stride of 1 or another constexpr is a compile of its own."""
    t = {"tensor": "bfloat16", "aligned": True}
    desc = {"descriptor": "bfloat16", "shape": [8192, 4, 128], "strides": [512, 128, 1], "block_shape": [64, 1, 128]}

    def append(stride, G=4):                 # kernels.decode:_append_kernel(K, V, KN, VN, POS, strides..., G=...)
        return {"fn": "kernels.decode:_append_kernel", "args": [t, t, t, t, t, stride, 768, 192, stride, 512, 128],
                "kwargs": {"G": G, "DK": 192, "DV": 128}}
    listed = [append(64), {"fn": "kernels.scoring:_score_topn_kernel", "args": [desc], "kwargs": {}}]
    run = tmp_path / "kernels.jsonl"
    for line, lacked in ((append(128), 0), (append(65), 1), (append(1), 1), (append(64, G=2), 1),
                         ({"fn": "kernels.scoring:_score_topn_kernel", "args": [{**desc, "shape": [65536, 4, 128]}],
                           "kwargs": {}}, 0),
                         ({"fn": "kernels.scoring:_score_topn_kernel",
                           "args": [{**desc, "shape": [1000, 4, 128], "strides": [520, 130, 1]}], "kwargs": {}}, 0),
                         ({"fn": "kernels.scoring:_score_topn_kernel",
                           "args": [{**desc, "block_shape": [32, 1, 128]}], "kwargs": {}}, 1)):
        run.write_text(json.dumps(line) + "\n")
        assert prewarm.unlisted(listed, run) == lacked, line
    assert launches.compile_key(append(64)) != launches.key(append(64))


def _triton_specialises():
    """Triton's own specialisation of an argument, (arg, specialise) -> what it compiles it as (the test skips
    where this Triton has no ``native_specialize_impl`` to ask)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError as e:
        pytest.skip(f"this Triton has no native_specialize_impl to ask: {e}")
    return lambda arg, specialise=True: native_specialize_impl(BaseBackend, arg, False, specialise, True)


def test_integers_fall_in_the_classes_triton_compiles_them_in():
    """``launches.int_class``, asked of this Triton: two integers share a class exactly where Triton
    specialises them alike (1, multiples of 16, the others, each as 32- or 64-bit by value); unspecialised
    (``do_not_specialize``), exactly where their types agree."""
    spec = _triton_specialises()
    values = [1, 0, 16, 32, -16, 17, 33, -1, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, 2 ** 31 + 1, 2 ** 40]
    for specialised in (True, False):
        triton_says = {v: spec(v, specialised) for v in values}
        for a in values:
            for b in values:
                assert (launches.int_class(a, specialised) == launches.int_class(b, specialised)) == \
                    (triton_says[a] == triton_says[b]), (a, b, specialised, triton_says[a], triton_says[b])


def test_triton_specialises_a_tensor_descriptor_on_its_dtype_and_block_shape_only():
    """``launches.compile_key``'s model of a descriptor, asked of this Triton: descriptors of one dtype and block
    shape but shapes and strides of every class (a multiple of 16 or not) specialise alike; another block shape
    does not. (A run's count of launches its list lacks rests on it: one that specialised on the shape made a
    list line of one length miss the run's launch of another, the kernel compiled all the same.)"""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor
    triton_spec = _triton_specialises()

    def spec(rows, stride, block):
        base = torch.empty(rows, 32, 192, dtype=torch.bfloat16)
        return triton_spec(TensorDescriptor(base, [rows, 32, 192], [stride, 192, 1], block))
    one = spec(1000, 6144, [64, 1, 128])
    assert spec(2000, 6144, [64, 1, 128]) == one and spec(1001, 6400, [64, 1, 128]) == one
    assert spec(1000, 6144, [32, 1, 128]) != one


def test_warming_processes_report_lines_the_code_outgrew_and_leave_a_marker(tmp_path, monkeypatch):
    """Lines that name no importable kernel fail alone, each reported (the suites compile what they
    need); every line done, the Triton cache gets the marker that lets a later run skip the warming."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    listed = tmp_path / "list.jsonl"
    listed.write_text("".join(json.dumps({"fn": fn, "args": [], "kwargs": {}, "at_s": i}) + "\n"
                              for i, fn in enumerate(["no_such_module:k", "nsa_validate.paths:REPO_ROOT",
                                                      "kernels.no_such_kernel:k"])))
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    assert not prewarm.warm_marker(listed).exists()
    w = prewarm.Prewarm(env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    w.go(listed, processes=2)
    for p in w.procs:
        p.wait(timeout=120)
    time.sleep(1.5)                 # the suites end later: the warming's wall time ends with its last line
    s = w.summary(run)
    assert (s["kernels"], s["processes"], s["compiled"], s["failed"], s["not_reached"], s["unlisted"]) == \
        (3, 2, 0, 3, 0, 0), s
    assert 0 < s["wall_s"] <= time.monotonic() - w.t0 - 1.5, s
    assert s["first_failure"].startswith(("no_such_module:k", "nsa_validate.paths:REPO_ROOT",
                                          "kernels.no_such_kernel:k")), s
    assert prewarm.warm_marker(listed).exists()
    assert "importing no_such_module: ModuleNotFoundError" in (run / "logs" / "prewarm.0.log").read_text()
    assert sorted(p.name for p in (run / "prewarm").iterdir()) == ["done.0.jsonl", "done.1.jsonl"]
    assert not w.scratch.exists()                         # its lines and logs kept in the run folder, the rest gone
    listed.write_text(listed.read_text() + json.dumps({"fn": "m:e", "args": [], "kwargs": {}}) + "\n")
    assert not prewarm.warm_marker(listed).exists()       # another list: warmed again


def test_the_warming_processes_import_the_kernels_once_and_stop_together(tmp_path):
    """One process imports the list's modules, then forks the others (each with its own log and lines):
    the module runs once, not once a process; stopping the run stops every one of them."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe_kernels.py").write_text(
        f"import os, time\nwith open({str(tmp_path / 'imports')!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
        "time.sleep(1)\n")                 # slow, as torch's import is: each process would have imported it
    listed = tmp_path / "list.jsonl"
    listed.write_text("".join(json.dumps({"fn": f"probe_kernels:k{i}", "args": [], "kwargs": {}, "at_s": i}) + "\n"
                              for i in range(6)))
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(tmp_path / "mods")]),
               TRITON_CACHE_DIR=str(tmp_path / "cache"))
    w = prewarm.Prewarm(env=env)
    w.go(listed, processes=3)
    for p in w.procs:
        p.wait(timeout=120)
    assert _lock_free(w.alive), "the warming's lock outlived its processes"
    s = w.summary(run)
    assert (s["processes"], s["failed"], s["not_reached"]) == (3, 6, 0), s     # k0..k5: no such kernel
    assert len((tmp_path / "imports").read_text().split()) == 1
    assert sorted(p.name for p in (run / "logs").glob("prewarm.*.log")) == [f"prewarm.{i}.log" for i in range(3)]
    # a list that keeps them busy: the summary of a run that ended first leaves none running
    (tmp_path / "mods" / "probe_slow.py").write_text(
        "import time\nclass Slow:\n    def warmup(self, *args, **kwargs):\n        time.sleep(60)\nk = Slow()\n")
    listed.write_text("".join(json.dumps({"fn": "probe_slow:k", "args": [i], "kwargs": {}}) + "\n" for i in range(3)))
    run = tmp_path / "run2"
    (run / "logs").mkdir(parents=True)
    w = prewarm.Prewarm(env=env)
    w.go(listed, processes=3)
    deadline = time.monotonic() + 60
    while len(list(w.work.glob("done.*.jsonl"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [w.procs[0].pid, *_children(w.procs[0].pid)]
    assert len(pids) == 3, pids
    # below the suites' CPU priority, all of them (a timed case may hold the GPU while they compile)
    assert {os.getpriority(os.PRIO_PROCESS, p) for p in pids} == {min(19, os.nice(0) + prewarm.NICE)}
    assert not _lock_free(w.alive), "a timed case would not wait for these (gpu_share.wait_warming)"
    w.summary(run)
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "a warming process outlived the run's summary"


def _lock_free(path) -> bool:
    """Could a timed case take the warming's lock (``gpu_share.wait_warming``) now, without waiting?"""
    import fcntl
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


class _Seen(prewarm.Prewarm):
    """A warming whose instances (and attempts) a test can find again (``execute`` makes its own)."""
    made: list = []
    tried = 0

    def __init__(self, env=None):
        _Seen.tried += 1
        super().__init__(env=env)
        _Seen.made.append(self)


@pytest.mark.parametrize("how", ["no-gpu", "bad-select", "bad-out"])
def test_a_run_that_does_not_warm_stops_the_early_process_and_leaves_nothing(tmp_path, monkeypatch, how):
    """The warming's first process starts with the run, before its profile is known; a run that then does
    not warm (no GPU, here the CPU profile) stops it and removes its scratch. A usage error the run can tell
    without torch (a -k pytest cannot parse, an --out that cannot be written) stops it before any process."""
    from nsa_validate.run.execute import RunRequest, execute
    from nsa_validate.errors import UsageError
    monkeypatch.setattr(prewarm, "may_warm", lambda select, level: True)
    monkeypatch.setattr(prewarm, "Prewarm", _Seen)
    _Seen.made, _Seen.tried = [], 0
    req = RunRequest([], "cpu", out=str(tmp_path / "runs"), select="(" if how == "bad-select" else None)
    if how == "bad-out":
        (tmp_path / "runs").write_text("a file")
    if how != "no-gpu":
        with pytest.raises(UsageError):
            execute(req)
        assert _Seen.tried == 0, "a warming process was started for a run that could not start"
        return
    out = execute(req)
    assert "prewarm" not in out.results["manifest"]
    (w,) = _Seen.made
    time.sleep(0.3)
    assert not _alive(w.procs[0].pid) and not w.scratch.exists()


def test_a_scratch_folder_that_cannot_be_made_only_skips_the_warming(tmp_path, monkeypatch):
    """The warming is a head start: where its scratch folder cannot be made (a full disk, here a temp
    folder under a file) the run goes on without it."""
    import tempfile

    from nsa_validate.run.execute import RunRequest, execute
    monkeypatch.setattr(prewarm, "may_warm", lambda select, level: True)
    monkeypatch.setattr(prewarm, "Prewarm", _Seen)
    _Seen.made, _Seen.tried = [], 0
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file" / "tmp"))
    out = execute(RunRequest([], "cpu", out=str(tmp_path / "runs")))
    assert (_Seen.tried, _Seen.made, out.status) == (1, [], "complete")


def _as_on_a_gpu(monkeypatch, tmp_path, listed):
    """``execute`` taking the CPU profile for a GPU's, with ``listed`` as its launch list (no suite runs:
    the request names none), so that the warming is told to go."""
    from nsa_validate.config import profiles
    resolve = profiles.resolve
    monkeypatch.setattr(profiles, "resolve", lambda name, level, loaded=None: (resolve(name, level, loaded)[0], "cuda"))
    monkeypatch.setattr(prewarm, "may_warm", lambda select, level: True)
    monkeypatch.setattr(prewarm, "list_for", lambda name, level: listed)
    monkeypatch.setattr(prewarm, "warm_marker", lambda kernels: tmp_path / "no-marker")
    monkeypatch.setattr(prewarm, "Prewarm", _Seen)
    _Seen.made, _Seen.tried = [], 0


def test_a_run_that_warms_keeps_the_record_and_leaves_nothing_running(tmp_path, monkeypatch):
    """Told the list once the run has its profile: the manifest says when it began and what it did, the
    run folder keeps its lines and logs, and no warming process or scratch folder outlives the run."""
    from nsa_validate.run.execute import RunRequest, execute
    listed = tmp_path / "list.jsonl"
    listed.write_text("".join(json.dumps({"fn": f"no_such_module:k{i}", "args": [], "kwargs": {}}) + "\n"
                              for i in range(3)))
    _as_on_a_gpu(monkeypatch, tmp_path, listed)
    from nsa_validate.env import envcheck
    collect = envcheck.collect

    def after_the_warming(**kw):         # no suite runs: the run would end, and stop it, at once
        for p in _Seen.made[0].procs:
            p.wait(timeout=120)
        return collect(**kw)
    monkeypatch.setattr(envcheck, "collect", after_the_warming)
    out = execute(RunRequest([], "cpu", out=str(tmp_path / "runs")))
    p = out.results["manifest"]["prewarm"]
    assert p["list"] == str(listed) and p["started_s"] >= 0 and (p["kernels"], p["not_reached"]) == (3, 0), p
    assert p["imported_s"] is not None and 0 < p["imported_s"] < 600, p      # its process stamped its imports' end
    assert (out.run_dir / "logs" / "prewarm.0.log").is_file() and list((out.run_dir / "prewarm").glob("done.*"))
    (w,) = _Seen.made
    assert not _alive(w.procs[0].pid) and not w.scratch.exists()


def test_a_usage_error_after_the_warming_began_stops_it(tmp_path, monkeypatch):
    """A run refused after its warming was told to go (here a baseline from another machine) stops every
    warming process and removes the scratch folder."""
    from nsa_validate.run.execute import RunRequest, execute
    from nsa_validate.errors import UsageError
    from nsa_validate.run import compare
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe_slow.py").write_text(
        "import time\nclass Slow:\n    def warmup(self, *args, **kwargs):\n        time.sleep(60)\nk = Slow()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), str(tmp_path / "mods")]))
    listed = tmp_path / "list.jsonl"
    listed.write_text("".join(json.dumps({"fn": "probe_slow:k", "args": [i], "kwargs": {}}) + "\n" for i in range(4)))
    _as_on_a_gpu(monkeypatch, tmp_path, listed)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})     # two warming processes

    def refuse(key, baseline):
        (w,) = _Seen.made
        deadline = time.monotonic() + 60
        while len(list(w.work.glob("done.*.jsonl"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)                  # the warming forked and is compiling (sleeping)
        refuse.pids = [w.procs[0].pid, *_children(w.procs[0].pid)]
        raise UsageError("another machine's baseline")
    monkeypatch.setattr(compare, "check_same_machine", refuse)
    with pytest.raises(UsageError):
        execute(RunRequest([], "cpu", out=str(tmp_path / "runs"), baseline={}))
    (w,) = _Seen.made
    assert len(refuse.pids) >= 2, refuse.pids
    time.sleep(0.5)
    assert not [p for p in refuse.pids if _alive(p)] and not w.scratch.exists()


def test_scratch_folders_of_runs_that_are_gone_are_swept(tmp_path, monkeypatch):
    """A run killed outright leaves its scratch folder; the next warming removes those whose run's pid is
    no live process, never a live run's."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = tmp_path / f"{prewarm.SCRATCH}999999999-abc"
    live = tmp_path / f"{prewarm.SCRATCH}{os.getpid()}-abc"
    for d in (gone, live):
        (d / "locks").mkdir(parents=True)
    prewarm._sweep()
    assert not gone.exists() and live.exists()


def test_the_early_process_told_nothing_ends_by_itself(tmp_path):
    """Its orders come on stdin: where they never come (the run ended: its end of the pipe closed) it
    ends, having imported torch and Triton only."""
    w = prewarm.Prewarm(env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    w.procs[0].stdin.close()
    assert w.procs[0].wait(timeout=120) == 0
    assert [f.name for f in w.work.iterdir()] == ["imported"]       # its imports' end stamped; nothing compiled
    w.close()
    assert not w.scratch.exists()


@pytest.mark.skipif(not GPU, reason="Triton compiles for a GPU only (the interpreter compiles nothing)")
def test_a_recorded_launch_warmed_elsewhere_is_a_cache_hit(tmp_path):
    """A process records a real kernel launch; another, on a fresh Triton cache, compiles the line
    without launching; a third launches the kernel for real on that cache and compiles nothing."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    listed = tmp_path / "kernels.jsonl"
    launch = ("import torch, triton\n"
              "from kernels.decode_layer import _copy_in_kernel\n"
              "hand = torch.zeros(2, dtype=torch.int64, device='cuda')\n"
              "x = torch.arange(5000, dtype=torch.int16, device='cuda'); out = torch.empty_like(x)\n"
              "hand[0] = x.data_ptr()\n"
              "_copy_in_kernel[(triton.cdiv(5000, 1024),)](hand, out, 5000, BLOCK=1024)\n"
              "assert torch.equal(out, x)\n")
    record = f"from nsa_validate.suite import launches\nlaunches.record({str(listed)!r}, 't')\n"
    subprocess.run([sys.executable, "-c", record + launch], env=dict(env, TRITON_CACHE_DIR=str(tmp_path / "c0")),
                   check=True, cwd=REPO_ROOT)
    (entry,) = launches.read(listed)
    assert entry["fn"] == "kernels.decode_layer:_copy_in_kernel" and entry["kwargs"] == {"BLOCK": 1024}
    warm = ("import ctypes, json, torch\nfrom nsa_validate.suite import launches\nlaunches.compile_only()\n"
            f"launches.warm(json.loads({json.dumps(entry)!r}))\n"
            # no CUDA context: the kernel was not loaded (a warming process needs none)
            "cu = ctypes.CDLL('libcuda.so.1'); flags, active = ctypes.c_uint(), ctypes.c_int()\n"
            "assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0\n"
            "assert active.value == 0, 'warming made a CUDA context'\n")
    subprocess.run([sys.executable, "-c", warm], env=env, check=True, cwd=REPO_ROOT)
    files = sorted(p for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert any(p.suffix == ".cubin" for p in files), files
    subprocess.run([sys.executable, "-c", launch], env=env, check=True, cwd=REPO_ROOT)
    assert sorted(p for p in (tmp_path / "cache").rglob("*") if p.is_file()) == files, (
        "the launch compiled again (kernel or launcher)")


def test_the_report_says_what_the_warming_did():
    from nsa_validate.report.markdown import _prewarm_line
    ran = {"list": "profiles/kernels/sm90-quick.jsonl", "kernels": 235, "processes": 15, "compiled": 233,
           "failed": 2, "first_failure": "kernels.x:k: ImportError", "not_reached": 0, "wall_s": 73.2,
           "cpu_s": 566.8, "unlisted": 4}
    line = _prewarm_line(ran)
    assert "233 of 235 launches" in line and "15 processes in 73.2 s" in line
    assert "from 1.4 s into the run" in _prewarm_line({**ran, "started_s": 1.4})
    assert "from 1.4 s into the run (its process had imported torch and Triton at 3.1 s)" in _prewarm_line(
        {**ran, "started_s": 1.4, "imported_s": 3.1})
    assert "2 failed (first: kernels.x:k: ImportError)" in line and "compiled 4 launches the list lacks" in line
    assert "an earlier run" in _prewarm_line({"list": "l", "skipped": "an earlier run compiled the list into this cache"})
    # a run killed (or stopped by a full disk) before the summary: the manifest has only its start
    assert "ended before its summary" in _prewarm_line({"list": "l", "started_s": 0.5})
    assert _prewarm_line(None) == ""
    beside = _prewarm_line({**ran, "alone_beside_s": {"a::bench": 2.5, "b::needle": 1.0}})
    assert ("2 cases held the GPU alone while the warming processes still compiled (on the CPU, at a lower "
            "priority): 3.5 s of their time alone") in beside


def test_a_cache_the_marker_cannot_be_written_to_still_gives_a_summary(tmp_path, monkeypatch):
    """The marker only saves a later run's warming: where Triton's cache cannot be written (read-only,
    a full disk) the run still gets its summary, and the next run warms again."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocked / "cache"))     # under a file: mkdir fails
    listed = tmp_path / "list.jsonl"
    listed.write_text(json.dumps({"fn": "no_such_module:k", "args": [], "kwargs": {}}) + "\n")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    w = prewarm.Prewarm(env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    w.go(listed, processes=1)
    for p in w.procs:
        p.wait(timeout=120)
    s = w.summary(run)
    assert (s["kernels"], s["failed"]) == (1, 1) and not prewarm.warm_marker(listed).exists()


def test_a_launch_list_that_cannot_be_written_never_fails_the_launch(tmp_path):
    """The list a suite process writes is a later run's head start: where it cannot be written (a full
    disk, here a path under a file) the launch that compiled goes on as if nothing were recorded."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    seen: set[str] = set()
    launches._note(str(blocked / "kernels.jsonl"), seen, "decode", _FakeJit(), (torch.zeros(2),), {"BLOCK": 4}, 1.0, 0.5)
    assert len(seen) == 1


class _FakeJit:
    """What ``launches._note`` reads of a JIT function: its Python function's module and name."""
    def __init__(self):
        self.fn = test_a_launch_list_that_cannot_be_written_never_fails_the_launch


def test_the_warming_takes_long_compiles_needed_late_before_short_ones_needed_sooner():
    """``prewarm.order``: by the latest moment a compile can start and be ready when the recording run needed it."""
    entries = [{"fn": "a", "at_s": 5.0, "compile_s": 1.0}, {"fn": "b", "at_s": 20.0, "compile_s": 18.0},
               {"fn": "c", "at_s": 1.0, "compile_s": 0.5}, {"fn": "d"}]
    assert [e["fn"] for e in prewarm.order(entries)] == ["d", "c", "b", "a"]
