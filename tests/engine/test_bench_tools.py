"""`bench.kernels`, `bench.kernel_ab`, `bench.attention`'s decode steps, `bench.answers` and `bench.host` end
to end on small settings: reports carry what the docs read, and the answer and bit comparisons find a difference
(no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import answers, attention, host, kernel_ab, kernels
from bench.common import build_engine
from raincheck_core import Prompt, SamplingParams
from raincheck_core.engine.plan import Kind
from raincheck_core.ops import native


def test_kernels_report_has_every_op(tmp_path):
    threads = torch.get_num_threads()
    try:
        kernels.main(["--repeats", "3", "--json", str(tmp_path / "k.json")])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "k.json").read_text())
    assert {r["op"] for r in rows} == {"decode attention, one layer", "fused step attention, one layer",
                                       "GDN layer, multi-row path", "GDN layer, decode rows",
                                       "linear layers of one decoder layer"}
    assert all(r["torch_ms"] > 0 and r["native_ms"] > 0 for r in rows)


@pytest.mark.skipif(native.library("paged_attention") is None, reason="no native kernels here")
def test_kernel_ab_times_both_builds_and_finds_changed_bits(tmp_path):
    kernel = native.SOURCE_DIR / "paged_attention.c"
    changed = tmp_path / "changed.c"
    changed.write_text(kernel.read_text().replace("dst[t] = a[t] * inv;", "dst[t] = a[t] * inv * 1.0001f;"))
    assert changed.read_text() != kernel.read_text()
    runs, threads = {}, torch.get_num_threads()
    try:
        for name, against in (("same", str(kernel)), ("changed", str(changed))):
            runs[name] = kernel_ab.main(["paged_attention", "--against", against, "--family", "qwen3_vl", "--ns",
                                         "2", "--rounds", "1", "--max-new", "24", "--bits"])
    finally:
        torch.set_num_threads(threads)
    assert runs["same"]["bits_equal"] and not runs["changed"]["bits_equal"] and runs["same"]["engines"] == 1
    row = runs["same"]["ns"][2]
    assert row["steps"] > 0 and row["p20_ms"]["this"] > 0 and row["p20_ms"]["against"] > 0
    assert native.loaded("paged_attention") is native.library("paged_attention")     # this tree's build again
    with pytest.raises(SystemExit, match="cannot read"):
        kernel_ab.main(["paged_attention", "--against", "no-such-revision", "--ns", "1", "--rounds", "1"])


@pytest.mark.skipif(native.library("row_linear") is None, reason="no native kernels here")
def test_kernel_ab_gives_builds_that_pack_differently_an_engine_each(monkeypatch):
    this = native.library("row_linear")
    # the same source, said to pack another width: each build must run in the engine that packed under it
    monkeypatch.setattr(kernel_ab, "row_linear_tile", lambda build: 48 if build is this else 64)
    threads = torch.get_num_threads()
    try:
        out = kernel_ab.main(["row_linear", "--against", str(native.SOURCE_DIR / "row_linear.c"), "--ns", "2",
                              "--rounds", "2", "--max-new", "20", "--bits"])
    finally:
        torch.set_num_threads(threads)
    assert out["engines"] == 2 and out["bits_equal"]
    earlier = "#define TILE 64\nint64_t row_linear_max_rows(void) { return 16; }\n"     # before the export
    assert kernel_ab.exported("row_linear", earlier).endswith("int64_t row_linear_tile(void) { return TILE; }\n")
    assert kernel_ab.exported("paged_attention", earlier) == earlier
    row = out["ns"][2]
    assert row["steps"] > 0 and row["p20_ms"]["this"] > 0 and row["p20_ms"]["against"] > 0
    assert native.loaded("row_linear") is this


def test_attention_decode_steps_record_the_engines_layouts(tmp_path):
    threads = torch.get_num_threads()
    try:
        attention.main(["--sessions", "1", "--repeats", "1", "--threads", "1", "--skip-accounting", "--json",
                        str(tmp_path / "a.json")])
    finally:
        torch.set_num_threads(threads)
    (row,) = json.loads((tmp_path / "a.json").read_text())["decode"]
    assert row["flex_ms"] > 0 and row["native_ms"] > 0
    # the flex step's accounting, from the layout the engine built: one decode row over its own context
    assert 1.0 <= row["score_ratio"] <= 1.25 and 1.0 <= row["kv_ratio"] <= 1.1


def test_answers_compare_finds_a_changed_answer(tmp_path, capsys):
    a = tmp_path / "a.json"
    answers.main(["--families", "single", "--dialogues", "1", "--json", str(a)])
    report = json.loads(a.read_text())
    assert set(report["single"]) == {name for name, _, _ in answers.ARMS}
    with pytest.raises(SystemExit) as same:
        answers.main(["--compare", str(a), str(a)])
    assert same.value.code == 0
    changed = json.loads(a.read_text())
    changed["single"]["full"][0][0] += " x"
    b = tmp_path / "b.json"
    b.write_text(json.dumps(changed))
    with pytest.raises(SystemExit) as differ:
        answers.main(["--compare", str(a), str(b)])
    assert differ.value.code == 1 and "1 different" in capsys.readouterr().out


def test_host_report_has_every_batch_and_a_steady_step(tmp_path):
    """On the tiny checkpoint (`--size tiny`): each B's steady steps are timed, the forward apart."""
    threads = torch.get_num_threads()
    try:
        host.main(["--bs", "1,3", "--families", "qwen3_vl", "--size", "tiny", "--repeats", "1", "--max-new", "4",
                   "--json", str(tmp_path / "h.json")])
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "h.json").read_text())["results"]["qwen3_vl"]
    assert set(results) == {"1", "3"}
    assert all(r["steps"] > 0 and 0 < r["forward_ms_median"] < r["step_ms_median"] for r in results.values())
    for r in results.values():      # every stage timed in the steady steps
        stages = r["stage_ms_median"]
        assert set(stages) == {*host.STAGES, host.CRITICAL, host.DEVICE} and stages["planning"] > 0
        assert stages["beside the forward"] > 0 and stages["after its logits"] > 0
        assert 0 < r["critical_ms_p20"] <= stages[host.CRITICAL]
        assert stages[host.DEVICE] == 0         # the native path stages nothing


def test_a_steps_stages_split_its_host_time_and_the_critical_path_leaves_out_what_ran_beside_the_forward():
    """`_split` on one step's marks (thread CPU seconds): the stages add up to the host time (step less
    forward), and the critical path is that less the stage beside the forward."""
    marks = {"planned": 10.2, "forward": 10.5, "forwarded": 12.5, "read": 12.9, "stepped": 13.4, host.DEVICE: 0.05}
    stages = {name: [] for name in (*host.STAGES, host.CRITICAL, host.DEVICE)}
    host._split(marks, start=10.0, step=3.5, forward=2.0, stages=stages)
    got = {name: round(v[0], 9) for name, v in stages.items()}
    assert got == {"planning": 0.2, "inputs": 0.3, "beside the forward": 0.4, "after its logits": 0.5, "rest": 0.1,
                   host.CRITICAL: 1.1, host.DEVICE: 0.05}
    assert round(sum(got[name] for name in host.STAGES), 9) == 1.5


def test_host_times_the_steps_that_restore_deferred_rows(tmp_path):
    """`--images`: each turn's image under raincheck, its deferred rows fused into the steps past the guard
    (a GDN join pending: the decode rows are tracked); the steady steps it times are those steps."""
    engine = build_engine("qwen3_5", tmp_path, prefix_cache=True, size="tiny", max_gdn_slots=8)
    load, kinds = host.Load(4), []
    remove = engine.on_plan(lambda plan: kinds.append([(s.kind, s.tracked) for s in plan.segments]))
    steps, forwards = host.host_steps(engine, load.batch(engine, 2, 0), 24, deferral=load.deferral)
    remove()
    assert len(steps) >= 16 and all(0 < f < s for s, f in zip(steps, forwards, strict=True))
    assert any(any(k is Kind.DEFERRED for k, _ in step) for step in kinds)
    assert any(any(k is Kind.DECODE and tracked for k, tracked in step) for step in kinds)
    threads = torch.get_num_threads()
    try:        # and end to end, as the command line runs it
        host.main(["--bs", "2", "--families", "qwen3_5", "--size", "tiny", "--repeats", "1", "--max-new", "24",
                   "--images", "4", "--json", str(tmp_path / "h.json")])
    finally:
        torch.set_num_threads(threads)
    (r,) = json.loads((tmp_path / "h.json").read_text())["results"]["qwen3_5"].values()
    assert r["steps"] >= 16


def test_host_times_the_graph_path_of_the_flex_backend(tmp_path):
    """`--backend flex --graphs`: the decode steps run padded over static batches, as a GPU's graph replays do;
    the steady steps it times are those (the engine met their skeletons and ran them from the static batch)."""
    engine = build_engine("qwen3_vl", tmp_path, prefix_cache=True, size="tiny", backend="flex")
    engine.use_step_graphs(False)
    steps, forwards = host.host_steps(engine, host.Load().batch(engine, 3, 0), 6)
    assert steps and all(0 < f < s for s, f in zip(steps, forwards, strict=True))
    assert engine.step_graphs.replays >= len(steps)
    threads = torch.get_num_threads()
    try:        # and end to end, as the command line runs it
        host.main(["--bs", "3", "--families", "qwen3_vl", "--size", "tiny", "--repeats", "1", "--max-new", "6",
                   "--backend", "flex", "--graphs", "--json", str(tmp_path / "h.json")])
    finally:
        torch.set_num_threads(threads)
    (r,) = json.loads((tmp_path / "h.json").read_text())["results"]["qwen3_vl"].values()
    # the step's host-built tensors staged and sent in one copy (ops/uploads.py), which the twin's device work
    # times, within the inputs
    assert r["steps"] > 0 and r["staged_copies_max"] == 1 and r["staged_tensors_median"] > 5
    stages = r["stage_ms_median"]
    assert 0 < stages[host.DEVICE] < stages["inputs"]


def test_host_with_the_forward_stubbed_runs_no_model_arithmetic(tmp_path):
    """`--stub-forward`: the steps run as served (the prefix cache, sampling, the update) around a forward that
    computes nothing: zero logits for the kept rows; the model's own forward is back afterwards."""
    engine = build_engine("qwen3_5", tmp_path, prefix_cache=True, size="tiny")
    prompt, params = Prompt(list(range(20, 60))), SamplingParams(max_new_tokens=8, ignore_eos=True)

    def answer() -> list[int]:
        return [t.token_id for t in engine.open_session().turn(prompt, params).tokens()]
    with host.stub_forward(engine):
        steps, forwards = host.host_steps(engine, host.Load().batch(engine, 3, 0), 5)
        stubbed = answer()
    assert steps and all(0 <= f < s for s, f in zip(steps, forwards, strict=True))
    assert stubbed == [0] * 8 and set(answer()) != {0}      # the model's own forward is back
    with pytest.raises(SystemExit):
        host.parse_args(["--stub-forward", "--images", "4"])
