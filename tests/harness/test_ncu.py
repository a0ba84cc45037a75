"""nsa_validate.measure.ncu: the metric table Nsight Compute 2025.3 printed on an H100 for a decode step
(its first two launches), parsed into one row per launch; what it cannot parse is an error."""
import pytest

from nsa_validate.measure import ncu

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
ROW = '"{id}","513","python3.12","127.0.0.1","{k}","1","7","(128, 1, 1)","(16, 1, 1)","0","9.0","Command line profiler metrics","{m}","{u}","{v}"'
OUT = "\n".join(["==PROF== Connected to process 513 (/usr/bin/python3.12)", "==PROF== Disconnected from process 513", HEAD,
                 ROW.format(id=0, k="_append_kernel", m="dram__bytes_read.sum", u="byte", v="52,480"),
                 ROW.format(id=0, k="_append_kernel", m="dram__bytes_write.sum", u="byte", v="0"),
                 ROW.format(id=1, k="_partial_kernel", m="dram__bytes_read.sum", u="byte", v="168,595,968"),
                 ROW.format(id=1, k="_partial_kernel", m="dram__bytes_write.sum", u="Mbyte", v="15.09248")])


def test_parse_one_row_per_launch_in_bytes():
    df = ncu.parse(OUT)
    assert list(df.kernel) == ["_append_kernel", "_partial_kernel"]
    assert list(df.id) == [0, 1]
    assert list(df.dram_read) == [52480.0, 168595968.0]
    assert df.dram_write.tolist() == pytest.approx([0.0, 15092480.0])


@pytest.mark.parametrize("text,why", [
    ("==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM", "no metric table"),
    (HEAD + "\n" + ROW.format(id=0, k="k", m="sm__cycles.sum", u="cycle", v="5"), "none of"),
    (HEAD + "\n" + ROW.format(id=0, k="k", m="dram__bytes_read.sum", u="cycle", v="5"), "units"),
], ids=["no-table", "other-metrics", "unit-not-bytes"])
def test_parse_refuses(text, why):
    with pytest.raises(ValueError, match=why):
        ncu.parse(text)


def test_no_counter_permission_is_its_own_error(monkeypatch):
    """ERR_NVGPUCTRPERM is a property of the machine (the suite skips with it), not a failed count."""
    class Done:
        returncode, stdout = 0, "==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM - The user does not have permission"
        stderr = ""
    monkeypatch.setattr(ncu.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(ncu.NoCounterAccess, match="ERR_NVGPUCTRPERM"):
        ncu.dram_bytes(["python", "-c", "pass"])
