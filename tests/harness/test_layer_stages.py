"""The layer's stage breakdown adds up what the layer runs: where its branches and mix run as one op
(every stage on the Triton kernels), that op is a stage and its parts, timed forward alone, are
shown bracketed and left out of the sums."""
import torch

from nsa_core import NSAAttention, routing, tiny
from nsa_validate.report import layer_table
from nsa_validate.bench import layer
from nsa_validate.report.extra import SuiteExtra

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_EVERYWHERE = routing.RoutingPolicy.triton_everywhere()


def test_one_op_only_where_every_stage_is_on_triton():
    import kernels  # noqa: F401  (registers the Triton backends)
    m = NSAAttention(tiny(), TRITON_EVERYWHERE)
    assert m.one_op(m.routes(64, DEV, torch.float32)) is not None
    m = NSAAttention(tiny(), routing.RoutingPolicy())
    assert m.one_op(m.routes(64, DEV, torch.float32)) is None


def _row(stages_fwd: dict, stages_bwd: dict) -> layer.Row:
    ms = lambda x: layer.Measured(ms=x, p20_ms=x, p80_ms=x, host_ms=0.1, peak_gib=1.0, timer="cuda")  # noqa: E731
    shape = layer.Shape(1, 65536, 2048, 4, 16, 128, 128)
    return layer.Row(shape, {}, nsa_fwd=ms(40.0), nsa_fwdbwd=ms(130.0), dense_fwd={}, dense_fwdbwd={}, dense={},
                     stages_fwd={k: ms(v) for k, v in stages_fwd.items()},
                     stages_bwd={k: ms(v) for k, v in stages_bwd.items()})


def test_sums_leave_out_the_one_ops_parts(tmp_path):
    row = _row({"projections": 3.0, "compression": 1.0, "cmp attention": 9.0, "scoring + top-n": 8.0,
                "sel attention": 17.0, "win attention": 3.0, "gate + out proj": 2.0, layer.ONE_OP: 38.0},
               {"projections": 6.0, "compression": 2.0, "gate + out proj": 4.0, layer.ONE_OP: 80.0})
    rec = layer_table.records([row])[0]
    assert rec["stages_fwd_sum_ms"] == 3 + 1 + 2 + 38 and rec["stages_bwd_sum_ms"] == 6 + 2 + 4 + 80
    assert layer_table._stage_cell(row, "sel attention").startswith("(") and "one op" in \
        layer_table._stage_cell(row, "sel attention")
    extra = SuiteExtra(str(tmp_path))
    layer_table.finish([row], extra, device="CPU")
    cells = extra.data["tables"][layer_table.STAGE_TABLE][0]
    assert cells["sum"].startswith("44.0") and cells[layer.ONE_OP].startswith("38.0")


def test_per_branch_rows_sum_every_stage():
    row = _row({"projections": 3.0, "cmp attention": 9.0, "gate + mix": 4.0}, {"projections": 6.0, "gate + mix": 8.0})
    rec = layer_table.records([row])[0]
    assert rec["stages_fwd_sum_ms"] == 16.0 and rec["stages_bwd_sum_ms"] == 14.0
