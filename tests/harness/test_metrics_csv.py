"""metrics.csv: one number per row, loadable with one pandas.read_csv, written with every run and by
`report`."""
import json

import pandas as pd

from nsa_validate.report import metrics_csv
from nsa_validate.report.schema import load_results, write_json
from tests.harness.test_cli import cli
from tests.harness.test_compare import make_run


def test_report_writes_a_long_metrics_csv_that_pandas_reads(tmp_path):
    run = make_run(tmp_path, "a", step_ms=0.142, layer_fwd_ms=52.4)
    res = load_results(run / "results.json")
    case = res["suites"]["decode"]["cases"][1]
    case["params"] = {"B": 16, "S": 65536}
    case["metrics"]["row"].update(pct_copy_bw=55.4, speedup_vs_dense=float("nan"), timer="cuda_graph", graph=True)
    write_json(run / "results.json", res)
    r = cli("report", str(run))
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(run / "metrics.csv")
    assert list(df.columns) == metrics_csv.COLUMNS
    assert (df.suite == "decode").any() and (df.suite == "layer").any()
    step = df[(df.case == "bench[B16-S65536]") & (df.metric == "graph.median_ms")].iloc[0]
    assert step.unit == "ms" and abs(step.value - 0.142) < 0.01 and step.gpu == "NVIDIA H100 80GB HBM3"
    assert json.loads(step.params) == {"B": 16, "S": 65536} and step.level == "standard" and step.commit == "abc1234"
    bw = df[df.metric == "row.pct_copy_bw"].iloc[0]
    assert bw.unit == "%" and bw.value == 55.4
    assert pd.isna(df[df.metric == "row.speedup_vs_dense"].iloc[0].value)        # NaN: an empty cell
    assert not df.metric.str.contains("samples_ms").any(), "raw samples belong in results.json"
    assert not (df.metric == "row.graph").any() and not (df.metric == "row.timer").any()   # not numbers
