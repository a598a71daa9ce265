"""`kiln bench`'s engine (the kiln.serve.bench package).

Unit tests check the settings, prompts, statistics and the planner comparison without a server. Integration
tests start a real tritonserver (the nvidia-pytriton one) on a repository holding kiln bench's deterministic
mock LLM (the ensemble's tensor contract, streamed, with a flags-only final response like a BLS model) and
a three-step mock ensemble, then load it: counts, zero errors, outputs equal to the expected text, mismatch
and error counting, written files, and a server that dies (or hangs) mid-run ending the bench in bounded time.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kiln.serve.bench import (
    BenchConfig,
    BenchError,
    BenchReport,
    Level,
    compare_with_plan,
    format_comparison,
    format_report,
    load_prompts,
    mock_expected_text,
    run_bench,
    run_level,
    synthetic_prompts,
    write_mock_repository,
)
from kiln.serve.bench.stats import Outcome, Recorder
from kiln.util.errors import InputError

OUT_LEN = 8


# ============================================================================================== unit


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"url": "http://127.0.0.1:8001"}, "host:port"),
        ({"url": "127.0.0.1:8001", "concurrency": (0, 4)}, "concurrency levels"),
        ({"url": "127.0.0.1:8001", "concurrency": ()}, "at least one level"),
        ({"url": "127.0.0.1:8001", "rate": -1.0}, "rate must be"),
        ({"url": "127.0.0.1:8001", "output_len": 0}, "output_len"),
        ({"url": "127.0.0.1:8001", "duration_s": 0}, "duration_s"),
        ({"url": "127.0.0.1:8001", "sampling": {"max_tokens": 3}}, "bench's own inputs"),
        ({"url": "127.0.0.1:8001", "sampling": {"temperature": "hot"}}, "sampling.temperature"),
        ({"url": "127.0.0.1:8001", "prompts": ()}, "prompts"),
        ({"url": "127.0.0.1:8001", "expected": {"a": "b"}}, "give prompts as well"),
        ({"url": "127.0.0.1:8001", "prompts": ("x",), "expected": {"a": "b"}}, "expected keys must be the prompts"),
        ({"url": "127.0.0.1:9000", "api": "openai"}, "base URL, e.g. http://127.0.0.1:9000/v1"),
        ({"url": "http://h:9000/v1", "api": "openai", "sampling": {"prompt": "x"}}, "bench's own inputs"),
    ],
)
def test_config_rejects_bad_settings(kwargs: dict, fragment: str) -> None:
    with pytest.raises(InputError, match="invalid bench settings") as info:
        BenchConfig(**kwargs)
    assert fragment in str(info.value)


def test_config_levels_and_json() -> None:
    cfg = BenchConfig(url="h:1", concurrency=(1, 4, 16), prompts=("a", "b"), expected={"a": "x"})
    assert [lv.label for lv in cfg.levels()] == ["c1", "c4", "c16"]
    assert BenchConfig(url="h:1", rate=2.5).levels() == [Level("rate", 2.5)]
    data = cfg.to_dict()
    json.dumps(data)  # JSON-ready
    assert data["prompts"] == "2 given" and data["expected"] == "1 references"
    assert data["concurrency"] == [1, 4, 16]


def test_synthetic_prompts_are_reproducible_distinct_and_sized() -> None:
    a = synthetic_prompts(20, 12, seed=3)
    assert a == synthetic_prompts(20, 12, seed=3)
    assert a != synthetic_prompts(20, 12, seed=4)
    assert len(set(a)) == 20
    assert all(len(p.split()) == 12 for p in a)


def test_load_prompts_formats(tmp_path: Path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n", encoding="utf-8")
    assert load_prompts(txt).prompts == ("first prompt", "second prompt")
    assert load_prompts(txt).expected is None

    jl = tmp_path / "p.jsonl"
    jl.write_text('"plain"\n{"prompt": "p2", "expected": " e2"}\n{"text_input": "p3"}\n', encoding="utf-8")
    ps = load_prompts(jl)
    assert ps.prompts == ("plain", "p2", "p3") and ps.expected == {"p2": " e2"}

    js = tmp_path / "p.json"
    js.write_text(json.dumps({"q1": "a1", "q2": "a2"}), encoding="utf-8")
    assert load_prompts(js).expected == {"q1": "a1", "q2": "a2"}

    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"prompt": 3}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"bad.jsonl:2"):
        load_prompts(bad)
    with pytest.raises(InputError, match="cannot read"):
        load_prompts(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(InputError, match="no prompt"):
        load_prompts(empty)


def test_bytes_tensor_parsing_matches_tritonclient() -> None:
    import numpy as np
    from tritonclient.utils import serialize_byte_tensor

    from kiln.serve.bench.loadgen import join_bytes_tensor

    items = [b" ab", "é\u4e2d".encode(), b"", b"x" * 300]
    raw = serialize_byte_tensor(np.array([items], dtype=object)).item()
    assert join_bytes_tensor(raw) == b"".join(items)


def _outcome(prompt: str, times: list[float], text: str, counts: list[int] | None = None) -> Outcome:
    return Outcome(
        prompt=prompt,
        t_send=0.0,
        t_end=times[-1] + 0.001,
        t_first=times[0],
        token_times=times,
        token_counts=counts or [1] * len(times),
        text=text,
    )


def test_recorder_statistics_mismatches_and_errors() -> None:
    cfg = BenchConfig(url="h:1", prompts=("p", "q"), expected={"p": "right"})
    rec = Recorder(cfg, Level("concurrency", 2), "responses")
    rec.t_start = 0.0
    rec.add(_outcome("p", [0.010, 0.020, 0.030], "right"))
    rec.add(_outcome("q", [0.020, 0.024], "anything"))  # no expected text for q: not checked
    rec.add(_outcome("p", [0.010, 0.020], "wrong"))
    rec.add(Outcome("q", 0.0, 0.5, error_kind="model", error="boom"))
    res = rec.result()
    assert res.completed == 2 and res.errors == 2 and res.mismatches == 1
    assert res.error_kinds == {"mismatch": 1, "model": 1}
    assert any("differs from the expected text" in s for s in res.error_samples)
    assert res.output_tokens == 5  # completed requests only
    assert res.ttft_p50_ms == pytest.approx(15.0)
    assert sorted([res.itl_p50_ms, res.itl_p90_ms, res.itl_p99_ms]) == [res.itl_p50_ms, res.itl_p90_ms, res.itl_p99_ms]
    assert res.itl_p50_ms == pytest.approx(10.0)
    assert res.duration_s == pytest.approx(0.5)
    assert res.requests_per_s == pytest.approx(2 / 0.5)


def test_recorder_divides_gaps_by_the_model_token_count() -> None:
    rec = Recorder(BenchConfig(url="h:1"), Level("concurrency", 1), "model")
    rec.t_start = 0.0
    rec.add(_outcome("p", [0.010, 0.050], "t", counts=[1, 4]))
    res = rec.result()
    assert res.output_tokens == 5
    assert res.itl_p50_ms == pytest.approx(10.0)  # 40 ms gap carrying 4 tokens


def test_recorder_leaves_token_figures_empty_when_unknown() -> None:
    rec = Recorder(BenchConfig(url="h:1", streaming=False), Level("concurrency", 1), "unknown")
    rec.t_start = 0.0
    rec.add(_outcome("p", [0.030], "t"))
    res = rec.result()
    assert res.output_tokens is None and res.output_tokens_per_s is None and res.itl_p50_ms is None
    assert res.completed == 1 and res.e2e_p50_ms == pytest.approx(31.0)


def _report(levels: list) -> BenchReport:
    return BenchReport({"model": "m", "url": "h:1", "input_len": 64, "output_len": 32}, {}, levels, "now", 1.0)


def test_compare_with_plan_uses_the_planners_speed_model() -> None:
    from kiln.plan import PlanInputs, SpeedModel, Workload, make_plan, resolve_gpu, shipped_model_config

    plan = make_plan(
        PlanInputs(model_config=shipped_model_config("hf:meta-llama/Llama-3.1-8B-Instruct"), weight_format="fp8"),
        resolve_gpu("h100"),
    )
    rec = Recorder(BenchConfig(url="h:1"), Level("concurrency", 4), "responses")
    rec.t_start = 0.0
    rec.add(_outcome("p", [0.010, 0.020, 0.030], "x"))
    level = rec.result()
    rows = compare_with_plan(_report([level]), plan)
    by_metric = {r.metric: r for r in rows}
    # The same prediction `kiln plan --isl 64 --osl 32 --concurrency 4` makes (input_len words ≈ tokens).
    expected, _ = SpeedModel(plan).predict(Workload(64, 32, 4))
    assert by_metric["ttft_p50_ms"].predicted == pytest.approx(expected.ttft_ms)
    assert by_metric["itl_p50_ms"].predicted == pytest.approx(expected.tpot_ms)
    assert by_metric["itl_p50_ms"].ratio == pytest.approx(10.0 / expected.tpot_ms)
    assert by_metric["e2e_p50_ms"].predicted == pytest.approx(expected.e2e_ms)
    assert by_metric["output_tokens_per_s"].predicted == pytest.approx(expected.output_tokens_per_s)
    assert "PyTorch backend" in by_metric["ttft_p50_ms"].basis  # the anchors' caveat travels with the figures
    # An explicit prompt length replaces input_len; a rate level has no fixed concurrency, so no prediction.
    other = {r.metric: r for r in compare_with_plan(_report([level]), plan, isl=1000)}
    assert other["ttft_p50_ms"].predicted == pytest.approx(SpeedModel(plan).predict(Workload(1000, 32, 4))[0].ttft_ms)
    rate = Recorder(BenchConfig(url="h:1", rate=3.0), Level("rate", 3.0), "responses")
    rate.t_start = 0.0
    assert compare_with_plan(_report([rate.result()]), plan) == []
    assert "x plan" in format_comparison(rows)
    # A workload the engine refuses (a prompt longer than max_input_len) gives the reason, not figures.
    (refused,) = compare_with_plan(_report([level]), plan, isl=5000)
    assert refused.metric == "none" and "max_input_len" in format_comparison([refused])


def test_bench_recipe_prints_the_plans_prediction_beside_each_level(kiln, monkeypatch, tmp_path) -> None:
    """`kiln bench --recipe` end to end through the CLI, with a stand-in for the load generator (a recorded
    level instead of a server): the "vs plan" column is the speed model's prediction for the same workload."""
    from conftest import CONFIGS

    import kiln.serve.bench as bench_pkg
    from kiln.plan import SpeedModel, Workload, plan_for
    from kiln.recipe.loader import load_recipe

    def stand_in_run_bench(cfg: BenchConfig) -> BenchReport:
        rec = Recorder(cfg, Level("concurrency", 4), "responses")
        rec.t_start = 0.0
        rec.add(_outcome("p", [0.050, 0.060, 0.070], "x"))
        return BenchReport(cfg.to_dict(), {}, [rec.result()], "now", 1.0)

    monkeypatch.setattr(bench_pkg, "run_bench", stand_in_run_bench)
    recipe = CONFIGS / "llama-3.1-8b" / "fp8.yaml"
    result = kiln("bench", "--concurrency", "4", "--input-len", "512", "--output-len", "128", "--recipe", recipe,
                  "--out", tmp_path)
    assert result.exit_code == 0, result.output
    expected, _ = SpeedModel(plan_for(load_recipe(recipe))).predict(Workload(512, 128, 4))
    rows = {line.split()[1]: line.split() for line in result.output.splitlines() if line.split()[:1] == ["c4"]}
    assert float(rows["ttft_p50_ms"][3]) == pytest.approx(expected.ttft_ms, abs=0.01)
    assert float(rows["itl_p50_ms"][3]) == pytest.approx(expected.tpot_ms, abs=0.01)
    assert float(rows["output_tokens_per_s"][3]) == pytest.approx(expected.output_tokens_per_s, abs=0.01)
    assert "x plan" in result.output and "PyTorch backend" in result.output


def test_mock_expected_text_is_pinned() -> None:
    # The mock's token algorithm (kiln/triton/models/mock_llm/mock_tokens.py), pinned: the served model and
    # mock_expected_text both run that one module, so a change to it shows here first.
    assert mock_expected_text("hello", 4) == " 7b16 3149 7269 2bc2"
    assert mock_expected_text("Zürich", 2) == " f862 68ac"
    assert mock_expected_text("hello", 0) == ""


def test_mock_repository_ships_the_model_and_its_token_module(tmp_path: Path) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from kiln.triton.repository import models_source

    repo = write_mock_repository(tmp_path / "repo", name="m", token_counts=True, final_with_last=True)
    write_mock_repository(repo, name="e", ensemble=True, token_delay_ms=2.5, instances=2)
    src = models_source()
    for model in ("m", "e_pre", "e_generate", "e_post"):
        version = repo / model / "1"
        assert sorted(p.name for p in version.iterdir()) == ["kiln_triton_utils.py", "mock_tokens.py", "model.py"]
        for name, source in (("model.py", src / "mock_llm" / "model.py"),
                             ("mock_tokens.py", src / "mock_llm" / "mock_tokens.py"),
                             ("kiln_triton_utils.py", src / "kiln_triton_utils.py")):
            assert (version / name).read_bytes() == source.read_bytes(), (model, name)
    configs = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        configs[path.parent.name] = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    assert sorted(configs) == ["e", "e_generate", "e_post", "e_pre", "m"]
    m = configs["m"]
    assert m.model_transaction_policy.decoupled and m.max_batch_size == 64
    assert [t.name for t in m.input] == ["text_input", "max_tokens", "stream", "return_num_output_tokens"]
    assert [t.name for t in m.output] == ["text_output", "num_output_tokens"]
    assert {k: v.string_value for k, v in m.parameters.items()} == {
        "role": "llm", "token_delay_ms": "0.0", "compute_ms": "0.0", "final_with_last": "true"}
    gen = configs["e_generate"]
    assert gen.model_transaction_policy.decoupled and gen.instance_group[0].count == 2
    assert gen.parameters["token_delay_ms"].string_value == "2.5"
    assert not configs["e_pre"].model_transaction_policy.decoupled
    steps = configs["e"].ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["e_pre", "e_generate", "e_post"]
    assert dict(steps[1].input_map) == {"input_ids": "_ids", "input_lengths": "_lengths",
                                        "request_output_len": "max_tokens", "streaming": "stream"}
    assert (repo / "e" / "1").is_dir()


# ============================================================================================== integration


def _start_server(repo: Path):
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    server = TritonServer(
        ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    )
    server.start(timeout_s=120)
    return server


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory: pytest.TempPathFactory):
    """One server for the module: ``mock`` (1 ms per token), ``mock_counts`` (also reports token counts),
    ``mock_ens`` (pre → generate → post ensemble)."""
    pytest.importorskip(
        "pytriton", reason="needs the tritonserver bundled in nvidia-pytriton (pip install kiln[serve])"
    )
    repo = tmp_path_factory.mktemp("bench") / "repo"
    write_mock_repository(repo, name="mock", token_delay_ms=1.0)
    write_mock_repository(repo, name="mock_counts", token_delay_ms=1.0, token_counts=True)
    write_mock_repository(repo, name="mock_ens", ensemble=True)
    write_mock_repository(repo, name="mock_last", final_with_last=True)
    server = _start_server(repo)
    try:
        yield server
    finally:
        server.stop()


def _prompts(n: int = 6) -> tuple[str, ...]:
    return tuple(synthetic_prompts(n, 10, seed=1))


def _expected(prompts: tuple[str, ...]) -> dict[str, str]:
    return {p: mock_expected_text(p, OUT_LEN) for p in prompts}


@pytest.mark.integration
def test_bench_levels_count_tokens_and_match_references(mock_server, tmp_path: Path) -> None:
    prompts = _prompts()
    cfg = BenchConfig(
        url=mock_server.urls()["grpc"],
        model="mock",
        concurrency=(1, 4),
        duration_s=2.0,
        output_len=OUT_LEN,
        prompts=prompts,
        expected=_expected(prompts),
        record_outputs=True,
    )
    report = run_bench(cfg)
    assert [lv.label for lv in report.levels] == ["c1", "c4"]
    assert report.total_errors == 0, format_report(report)
    assert report.model["token_basis"] == "responses" and report.model["decoupled"] is True
    for lv in report.levels:
        assert lv.completed > 5 and lv.sent == lv.completed and lv.mismatches == 0
        assert lv.responses == lv.completed * OUT_LEN  # one streamed response per token, finals not counted
        assert lv.output_tokens == lv.completed * OUT_LEN
        assert lv.requests_per_s == pytest.approx(lv.completed / lv.duration_s)
        assert 2.0 <= lv.duration_s < 2.0 + 5.0
        for name in ("ttft", "itl", "e2e"):
            p50, p90, p99 = (getattr(lv, f"{name}_{q}_ms") for q in ("p50", "p90", "p99"))
            assert 0 < p50 <= p90 <= p99, name
        # 1 ms sleep per token: a gap can never be shorter, and a request takes at least OUT_LEN of them.
        assert lv.itl_p50_ms >= 0.9 and lv.e2e_p50_ms >= OUT_LEN * 0.9 and lv.ttft_p50_ms < lv.e2e_p50_ms
        assert lv.outputs == {p: mock_expected_text(p, OUT_LEN) for p in prompts}
    # Four clients get more done than one.
    assert report.levels[1].requests_per_s > report.levels[0].requests_per_s

    paths = report.write(tmp_path / "out")
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert [lv["label"] for lv in data["levels"]] == ["c1", "c4"] and data["total_errors"] == 0
    rows = list(csv.DictReader(paths["csv"].open(encoding="utf-8")))
    assert [r["label"] for r in rows] == ["c1", "c4"]
    assert int(rows[1]["completed"]) == report.levels[1].completed and rows[1]["errors_mismatch"] == "0"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000


@pytest.mark.integration
def test_wrong_expected_text_is_counted_as_mismatch(mock_server) -> None:
    prompts = _prompts(4)
    expected = _expected(prompts)
    expected[prompts[1]] = expected[prompts[1]][:-1] + "!"  # one reference wrong in its last character
    cfg = BenchConfig(
        url=mock_server.urls()["grpc"],
        model="mock",
        concurrency=(2,),
        max_requests=20,
        duration_s=30,
        output_len=OUT_LEN,
        prompts=prompts,
        expected=expected,
    )
    lv = run_bench(cfg).levels[0]
    assert lv.sent == 20
    assert lv.mismatches == 5 and lv.errors == 5 and lv.completed == 15  # prompts are used in turn
    assert lv.error_kinds == {"mismatch": 5}
    assert f"at character {OUT_LEN * 5 - 1}" in lv.error_samples[0]
    unchecked = run_bench(dataclasses.replace(cfg, expected=None)).levels[0]
    assert unchecked.errors == 0 and unchecked.completed == 20


@pytest.mark.integration
def test_model_errors_are_counted_not_hidden(mock_server) -> None:
    prompts = ("kiln-mock-fail please", *_prompts(3))
    cfg = BenchConfig(
        url=mock_server.urls()["grpc"],
        model="mock",
        concurrency=(2,),
        max_requests=16,
        duration_s=30,
        output_len=OUT_LEN,
        prompts=prompts,
        expected=_expected(prompts[1:]),
    )
    lv = run_bench(cfg).levels[0]
    assert lv.error_kinds == {"model": 4} and lv.completed == 12
    assert "asks the mock to fail" in lv.error_samples[0]
    assert "4 errors (model=4)" in format_report(BenchReport({}, {}, [lv], "now", 1.0))


@pytest.mark.integration
def test_model_token_counts_and_non_streaming(mock_server) -> None:
    prompts = _prompts(3)
    base = dict(
        url=mock_server.urls()["grpc"],
        concurrency=(2,),
        max_requests=10,
        duration_s=30,
        output_len=OUT_LEN,
        prompts=prompts,
        expected=_expected(prompts),
    )
    counted = run_bench(BenchConfig(model="mock_counts", **base))
    lv = counted.levels[0]
    assert counted.model["token_basis"] == "model" and lv.errors == 0
    assert lv.output_tokens == 10 * OUT_LEN
    # Not streaming: one response per request carrying all tokens, counted by the model.
    single = run_bench(BenchConfig(model="mock_counts", streaming=False, **base)).levels[0]
    assert single.errors == 0 and single.responses == 10 and single.output_tokens == 10 * OUT_LEN
    assert single.itl_p50_ms is None  # one response: no inter-token gap to measure
    # Without the model's count, non-streaming token figures stay empty rather than guessed.
    unknown = run_bench(BenchConfig(model="mock", streaming=False, **base)).levels[0]
    assert unknown.errors == 0 and unknown.token_basis == "unknown" and unknown.output_tokens_per_s is None


@pytest.mark.integration
def test_final_flag_on_the_last_token_response(mock_server) -> None:
    # The tensorrt_llm backend marks its last data response final (no empty final response follows).
    prompts = _prompts(3)
    cfg = BenchConfig(
        url=mock_server.urls()["grpc"],
        model="mock_last",
        concurrency=(2,),
        max_requests=10,
        duration_s=30,
        output_len=OUT_LEN,
        prompts=prompts,
        expected=_expected(prompts),
    )
    lv = run_bench(cfg).levels[0]
    assert lv.errors == 0 and lv.completed == 10 and lv.responses == 10 * OUT_LEN


@pytest.mark.integration
def test_ensemble_and_rate_mode(mock_server) -> None:
    prompts = _prompts()
    url = mock_server.urls()["grpc"]
    ens = run_bench(
        BenchConfig(
            url=url,
            model="mock_ens",
            concurrency=(4,),
            duration_s=1.5,
            output_len=OUT_LEN,
            prompts=prompts,
            expected=_expected(prompts),
        )
    ).levels[0]
    assert ens.errors == 0 and ens.completed > 5 and ens.output_tokens == ens.completed * OUT_LEN

    lv = asyncio_run(
        run_level(
            BenchConfig(
                url=url,
                model="mock",
                rate=40.0,
                poisson=True,
                duration_s=2.0,
                output_len=OUT_LEN,
                prompts=prompts,
                expected=_expected(prompts),
            ),
            40.0,
        )
    )
    assert lv.mode == "rate" and lv.rate == 40.0 and lv.errors == 0
    assert 40 <= lv.sent <= 130  # ~80 expected from a Poisson process at 40/s for 2 s
    assert lv.completed == lv.sent and lv.send_lag_p50_ms is not None


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


@pytest.mark.integration
def test_request_timeout_is_an_error(mock_server) -> None:
    cfg = BenchConfig(
        url=mock_server.urls()["grpc"],
        model="mock",
        concurrency=(2,),
        duration_s=0.5,
        output_len=400,
        request_timeout_s=0.15,
    )
    t0 = time.monotonic()
    lv = run_bench(cfg).levels[0]
    assert time.monotonic() - t0 < 5
    assert lv.completed == 0 and lv.errors == lv.sent >= 2 and lv.error_kinds == {"timeout": lv.sent}


@pytest.mark.integration
def test_unknown_model_and_unreachable_server(mock_server) -> None:
    from kiln.serve.server import free_port

    with pytest.raises(BenchError, match="not available"):
        run_bench(BenchConfig(url=mock_server.urls()["grpc"], model="nope"))
    with pytest.raises(BenchError, match="does not have the tensors"):
        run_bench(BenchConfig(url=mock_server.urls()["grpc"], model="mock_ens_pre"))
    t0 = time.monotonic()
    with pytest.raises(BenchError, match="cannot reach"):
        run_bench(BenchConfig(url=f"127.0.0.1:{free_port()}", model="mock"))
    assert time.monotonic() - t0 < 15


def _bench_in_thread(url: str, rate: float | None) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def target() -> None:
        try:
            result["report"] = run_bench(
                BenchConfig(url=url, model="mock", concurrency=(8,), rate=rate, duration_s=120, output_len=OUT_LEN)
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.integration
@pytest.mark.parametrize("how, rate", [("killed", None), ("hung", None), ("killed", 50.0)])
def test_server_failure_mid_run_ends_the_bench(tmp_path: Path, how: str, rate: float | None) -> None:
    pytest.importorskip(
        "pytriton", reason="needs the tritonserver bundled in nvidia-pytriton (pip install kiln[serve])"
    )
    server = _start_server(write_mock_repository(tmp_path / "repo", name="mock", token_delay_ms=1.0))
    try:
        thread, result = _bench_in_thread(server.urls()["grpc"], rate)
        time.sleep(2.0)
        assert thread.is_alive(), result
        failed_at = time.monotonic()
        os.kill(server.proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the bench did not stop after the server failed"
        error = result.get("error")
        assert isinstance(error, BenchError), result
        assert error.exit_code != 0 and "stopped answering" in str(error)
        took = result["ended"] - failed_at
        print(f"bench stopped {took:.1f}s after the server was {how}")
        assert took < 10.0
    finally:
        if how == "hung" and server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


# ============================================================================ kiln bench --openai
@pytest.mark.integration
def test_openai_bench_has_the_same_report(mock_server, tmp_path: Path) -> None:
    """`kiln bench --openai URL`: the same levels and report against an OpenAI-compatible server (kiln's, in front
    of the mock): texts match, the server's usage counts the tokens, model errors are counted."""
    from click.testing import CliRunner

    from kiln.cli.main import cli
    from kiln.serve.openai import OpenAIConfig, OpenAIServer
    from kiln.serve.server import free_port

    prompts = _prompts(4)
    cfg = OpenAIConfig(triton_url=mock_server.urls()["grpc"], triton_model="mock_counts", port=free_port())
    with OpenAIServer(cfg):
        url = f"{cfg.url}/v1"
        report = run_bench(BenchConfig(url=url, api="openai", concurrency=(1, 4), duration_s=1.5, output_len=OUT_LEN,
                                       prompts=prompts, expected=_expected(prompts)))
        assert report.total_errors == 0, format_report(report)
        assert report.model == {"name": "mock_counts", "api": "openai", "url": url, "token_basis": "model"}
        assert report.config["model"] == "mock_counts", "the model that ran labels the report, not 'ensemble'"
        # the server's usage.prompt_tokens, summed (the mock reports no count and its server has no tokenizer: 0)
        assert [lv.prompt_tokens for lv in report.levels] == [0, 0]
        for lv in report.levels:
            assert lv.completed > 3 and lv.mismatches == 0 and lv.output_tokens == lv.completed * OUT_LEN
            assert 0 < lv.ttft_p50_ms <= lv.e2e_p50_ms and lv.itl_p50_ms >= 0.9  # the mock sleeps 1 ms per token
        # The bench never counts fewer tokens than it saw chunks, so the figures above hold even if the server's
        # usage said 1: read the usage itself, streamed and not (OUT_LEN tokens each).
        import requests

        body = {"model": "mock_counts", "prompt": prompts[0], "max_tokens": OUT_LEN}
        plain = requests.post(f"{url}/completions", json=body, timeout=30).json()
        assert plain["usage"]["completion_tokens"] == OUT_LEN, plain
        streamed = requests.post(f"{url}/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}, timeout=30)
        events = [json.loads(line[5:]) for line in streamed.text.splitlines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
        assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [OUT_LEN], events
        failing = run_bench(BenchConfig(url=url, api="openai", concurrency=(2,), duration_s=1.0, output_len=OUT_LEN,
                                        prompts=(prompts[0], "kiln-mock-fail now")))
        level = failing.levels[0]
        assert level.error_kinds.get("model", 0) > 0 and level.completed > 0
        assert "mock model failed" in level.error_samples[0]
        out = CliRunner().invoke(cli, ["bench", "--openai", url, "--concurrency", "2", "--duration", "1",
                                       "--output-len", "4", "--out", str(tmp_path / "cli")])
        assert out.exit_code == 0, out.output
        assert "output tokens counted from: model" in out.output and (tmp_path / "cli" / "bench.json").is_file()
        assert out.output.startswith(f"model mock_counts at {url}") and "server-counted tokens: prompt 0" in out.output
    with pytest.raises(BenchError, match="cannot reach the OpenAI-compatible server"):
        run_bench(BenchConfig(url=f"http://127.0.0.1:{free_port()}/v1", api="openai", duration_s=1))
