"""Decode roofline helpers: a flat, host-bound curve is labelled launch-bound."""
from nsa_validate.measure import roofline


def test_bytes_and_bandwidth():
    # paper config, 64k context: 5631 tokens per KV head, (192 + 128) bf16, G = 4, B = 16
    b = roofline.bytes_read(5631, 192, 128, 2, 4, 16)
    assert b == 5631 * 320 * 2 * 4 * 16
    assert abs(roofline.achieved_gbs(b, 0.1) - b / 1e-4 / 1e9) < 1e-6


def test_flat_host_bound_curve_is_labelled_launch_bound():
    """~5-6 ms per step from 128 to 4096 tokens (a bench timing Python): the time ignores a 32x growth in bytes."""
    rows = [{"S": S, "bytes": roofline.bytes_read(S, 192, 128, 2, 4, 1), "step_ms": ms}
            for S, ms in [(128, 5.4), (512, 5.6), (1024, 5.5), (4096, 5.9)]]
    out = roofline.label(rows)
    assert all(r["launch_bound"] for r in out)
    assert "flat" in out[0]["launch_bound_why"]


def test_a_curve_that_grows_with_the_bytes_is_not_labelled():
    rows = [{"S": S, "bytes": roofline.bytes_read(S, 192, 128, 2, 4, 16), "step_ms": ms, "eager_ms": ms * 1.1,
             "graph_ms": ms} for S, ms in [(4096, 0.02), (16384, 0.05), (65536, 0.17)]]
    assert not any(r["launch_bound"] for r in roofline.label(rows))


def test_eager_much_slower_than_graph_is_labelled():
    rows = [{"S": 4096, "bytes": 1, "step_ms": 0.5, "eager_ms": 0.5, "graph_ms": 0.1}]
    r = roofline.label(rows)[0]
    assert r["launch_bound"] and "eager/graph 5.0" in r["launch_bound_why"]
    assert roofline.eager_graph_launch_bound(1.0, None) is None


def test_host_bound_sweep_is_labelled_launch_bound_in_the_report(tmp_path):
    """A host-bound bench, reproduced: a 'step' whose time is host overhead (a fixed sleep, the
    cache never read) timed over 128..4096 tokens. The decode table and report.md say launch-bound,
    because the curve is flat while the bytes grow 32x — with the timer label on top."""
    import time

    from nsa_core.config import PAPER
    from nsa_validate.measure import timing
    from nsa_validate.report import decode_table, markdown
    from nsa_validate.report.extra import SuiteExtra
    from nsa_validate.report.schema import CaseRecord, SuiteResult, verdict

    def host_bound_step():
        time.sleep(0.003)

    rows = []
    for S in (128, 512, 1024, 4096):
        t = timing.bench(host_bound_step, device="cpu", reps=5)
        tokens = sum(PAPER.expected_reads(S - 1).values())
        rows.append({"B": 1, "S": S, "timer": "cuda_events", "step_ms": t.median_ms, "eager_ms": t.median_ms,
                     "graph_ms": None, "tokens_read": tokens, "speedup_vs_dense": None, "expected_speedup": None,
                     "bytes": roofline.bytes_read(tokens, PAPER.d_k, PAPER.d_v, 2, PAPER.n_kv_heads, 1)})
    extra = SuiteExtra(str(tmp_path / "suites" / "decode"))
    meta = {"run_id": "abc1234/20261123T000000Z-host", "gpu": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
            "level": "standard", "dtype": "bf16"}
    rows[-1].update(step_ws_min_ms=rows[-1]["step_ms"], step_ws_max_ms=1.06 * rows[-1]["step_ms"], workspaces=3)
    rows[0].update(step_ws_min_ms=rows[0]["step_ms"], step_ws_max_ms=1.02 * rows[0]["step_ms"], workspaces=3)
    df = decode_table.finish(rows, extra, meta=meta)
    assert df.launch_bound.all() and df.launch_bound_why.str.contains("flat").all()
    # workspaces further apart than WS_SPREAD get a note (the S=4096 row), closer ones not (S=128)
    spread = [n for n in extra.data["notes"] if "workspaces took" in n]
    assert len(spread) == 1 and spread[0].startswith("B=1, S=4096:") and "6.0% apart" in spread[0], spread
    import pandas as pd
    csv = pd.read_csv(tmp_path / "suites" / "decode" / "decode.csv")
    assert list(csv.columns[:5]) == list(meta) and (csv.gpu == meta["gpu"]).all() and len(csv) == 4
    s = {"decode": SuiteResult("decode", "pass", 1.0, [CaseRecord("bench[B1-S128]", "decode", "pass")],
                               extra=extra.data)}
    res = {"manifest": {"command": []}, "env": {}, "suites": {n: x.to_dict() for n, x in s.items()},
           "verdict": verdict(s, strict=False)}
    md = markdown.render(res)
    table = [ln for ln in md.splitlines() if ln.startswith("| 1 |")]
    assert len(table) == 4 and all("yes: time flat" in ln for ln in table), table
    # report --embed-plots: each plot's data inline as a Mermaid chart (GitHub strips data: images)
    assert "```mermaid" not in md
    md = markdown.render(res, embed_plots=True)
    charts = md.count("```mermaid")
    assert charts == len(extra.data["plots"]) and "xychart-beta" in md, md[-1500:]
    assert 'x-axis "context" ["128", "512", "1k", "4k"]' in md
    step = [float(f"{r['step_ms'] * 1e3:.4g}") for r in sorted(rows, key=lambda r: r["S"])]   # µs, 4 digits
    line = next(ln for ln in md.splitlines() if ln.strip().startswith("line ["))
    assert [float(x) for x in line.strip()[6:-1].split(",")] == step, (line, step)


def test_dram_rows_put_each_launch_beside_its_formula_share():
    """The ncu table: a row per launch (the ratio only where a launch reads the cache), then the whole
    step with the bytes counted from the indices. Figures from an H200 step (B=16, 128k)."""
    import pandas as pd

    from nsa_validate.report import decode_table
    launches = ("append", "compressed partial (+ block sums)", "block scores", "top-n", "window + selection partial", "merge")
    df = pd.DataFrame({"kernel": ["_append_kernel", "_partial_kernel", "_scores_kernel", "_topn_kernel", "_partial_kernel",
                                  "_merge_kernel"],
                       "dram_read": [0.05e6, 337.18e6, 9.59e6, 0.57e6, 57.98e6, 10.16e6],
                       "dram_write": [0.0, 14.89e6, 0.0, 0.0, 0.06e6, 0.0]})
    rows = decode_table.dram_rows(df, launches, 16, 131072, {1: 335.50e6, 4: 62.91e6}, 398.42e6, 398.42e6, 392.89e6)
    assert [r["launch"] for r in rows] == [*launches, "whole step"]
    assert rows[1]["read / formula"] == "1.005" and rows[4]["read / formula"] == "0.922" and rows[0]["read / formula"] == ""
    assert rows[-1]["DRAM read MB"] == "415.53" and rows[-1]["read / formula"] == "1.043"
    assert "392.89 MB distinct" in rows[-1]["kernel"]


def test_the_copy_bandwidth_note_gives_every_process_s_figure():
    """Each bench process measures the copy bandwidth its rows' % divide by: the report's line names one figure
    only where they agree, else their range (a pod's processes measured 4198-4240 GB/s)."""
    from nsa_validate.report import decode_table
    assert decode_table.copy_note([{"copy_gbs": None}]) is None
    assert decode_table.copy_note([{"copy_gbs": 4235.2}, {"copy_gbs": 4234.9}]) == (
        "measured device copy bandwidth: 4235 GB/s (1 GiB copy, read + write)")
    spread = decode_table.copy_note([{"copy_gbs": 4237.0}, {"copy_gbs": 4198.4}, {"copy_gbs": 4240.2}])
    assert "4198-4240 GB/s" in spread and "each row's % copy bw against its own" in spread
