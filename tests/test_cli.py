"""The CLI foundation: validate / show / ls / new, exit codes (0 ok, 2 bad input) and error output.

Run in-process with click's CliRunner (fast); one test runs the installed `kiln` executable to prove a real
process prints no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import CONFIGS, recipe_id, shipped_recipes

from kiln.recipe.loader import load_recipe, recipe_from_dict
from kiln.recipe.schema import Recipe

FP8 = CONFIGS / "llama-3.1-8b" / "fp8.yaml"
TINY = CONFIGS / "tiny-llama.yaml"

THREE_MISTAKES = """\
# a recipe with three mistakes
name: three-mistakes
target: reference
quantization:
  format: int4_awq
  calibration:
    samples: 32
    sampels: 16
engine:
  max_input_len: 512
  max_seq_len: 128
serving:
  batching: inflight
"""


def resolved(recipe: Recipe) -> dict:
    """A recipe's content without `extends` (which `kiln show` leaves out: its output is fully resolved)."""
    return recipe.model_dump(exclude={"extends"})


def assert_bad_input(result) -> None:
    """Exit 2 from kiln's own error handling: a message, no traceback, no escaped exception."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert "error" in result.output


# --------------------------------------------------------------------------------------- shipped recipes


@pytest.mark.parametrize("path", shipped_recipes(), ids=recipe_id)
def test_validate_every_shipped_recipe(kiln, path: Path):
    result = kiln("validate", path)
    assert result.exit_code == 0, result.output
    assert f"{path}: ok — {load_recipe(path).recipe.name}" in result.stdout


def test_ls_lists_every_shipped_recipe(kiln, monkeypatch):
    monkeypatch.delenv("KILN_CONFIGS", raising=False)
    result = kiln("ls")
    assert result.exit_code == 0, result.output
    rows = result.stdout.splitlines()
    expected = shipped_recipes()
    assert len(rows) == len(expected)
    for path, row in zip(expected, rows):
        name = load_recipe(path).recipe.name
        assert row.split()[:2] == [recipe_id(path), name], row


def test_ls_recurses_skips_sweeps_and_flags_broken_recipes(kiln, monkeypatch, write_recipe, tmp_path):
    write_recipe("name: top\ntarget: reference\n", "top.yaml")
    write_recipe("name: deep\ntarget: reference\n", "a/b/deep.yaml")
    write_recipe("name: broken\nbild: {}\n", "a/broken.yaml")
    write_recipe("grid: {engine.max_batch_size: [1, 2]}\n", "sweeps/grid.yaml")
    monkeypatch.setenv("KILN_CONFIGS", str(tmp_path))
    result = kiln("ls")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert set(rows) == {"top.yaml", "a/b/deep.yaml", "a/broken.yaml"}
    assert "1 problem(s)" in rows["a/broken.yaml"]


@pytest.mark.parametrize("path", shipped_recipes(), ids=recipe_id)
def test_show_loads_back_to_an_equal_recipe(kiln, path: Path):
    result = kiln("show", path)
    assert result.exit_code == 0, result.output
    shown = recipe_from_dict(yaml.safe_load(result.stdout))
    assert resolved(shown) == resolved(load_recipe(path).recipe)
    assert shown.extends is None  # fully resolved: nothing left to inherit


def test_show_doc_has_comments_and_still_loads_back(kiln):
    plain = kiln("show", FP8).stdout
    result = kiln("show", FP8, "--doc")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    comments = [line for line in lines[1:] if line.lstrip().startswith("# ")]
    assert len(comments) > len(Recipe.model_fields)  # every field documented, nested ones too
    # each field's description sits right above it
    i = lines.index("  max_batch_size: 256")
    assert lines[i - 1].lstrip().startswith("# ") and "sequences in flight" in " ".join(lines[i - 3:i])
    assert not any(line.lstrip().startswith("# ") for line in plain.splitlines()[1:])
    assert resolved(recipe_from_dict(yaml.safe_load(result.stdout))) == resolved(load_recipe(FP8).recipe)


def test_show_applies_set_and_says_so(kiln):
    result = kiln("show", FP8, "--set", "engine.max_batch_size=64")
    assert result.exit_code == 0, result.output
    assert recipe_from_dict(yaml.safe_load(result.stdout)).engine.max_batch_size == 64
    assert "with --set engine.max_batch_size=64" in result.stdout.splitlines()[0]
    assert recipe_from_dict(yaml.safe_load(kiln("show", FP8).stdout)).engine.max_batch_size == 256  # from the base


def test_recipes_are_found_by_name(kiln):
    result = kiln("show", "llama-3.1-8b-fp8")
    assert result.exit_code == 0, result.output
    assert recipe_from_dict(yaml.safe_load(result.stdout)).name == "llama-3.1-8b-fp8"


# --------------------------------------------------------------------------------------- kiln new


def test_new_copies_with_name_replaced_and_extends_repointed(kiln, tmp_path):
    out = tmp_path / "tmp" / "x.yaml"
    result = kiln("new", "my-fp8", "--from", FP8, "--out", out)
    assert result.exit_code == 0, result.output
    assert kiln("validate", out).exit_code == 0
    text = out.read_text()
    data = yaml.safe_load(text)
    assert data["name"] == "my-fp8"
    assert (out.parent / data["extends"]).resolve() == (CONFIGS / "base" / "llama-3.1-8b.yaml").resolve()
    assert data["extends"] != yaml.safe_load(FP8.read_text())["extends"]  # re-pointed, not copied
    copy, source = load_recipe(out).recipe, load_recipe(FP8).recipe
    assert copy.name == "my-fp8"
    assert resolved(copy) | {"name": None} == resolved(source) | {"name": None}


def test_new_refuses_to_overwrite(kiln, tmp_path):
    out = tmp_path / "x.yaml"
    out.write_text("name: mine\n")
    result = kiln("new", "copy", "--from", TINY, "--out", out)
    assert_bad_input(result)
    assert "already exists" in result.output
    assert out.read_text() == "name: mine\n"


def test_new_from_a_shipped_name_with_default_out(kiln, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = kiln("new", "my-tiny", "--from", "tiny-llama")
    assert result.exit_code == 0, result.output
    assert load_recipe(tmp_path / "my-tiny.yaml").recipe.name == "my-tiny"


def test_new_repoints_extends_written_with_quotes_and_a_comment(kiln, write_recipe, tmp_path):
    base = CONFIGS / "base" / "llama-3.1-8b.yaml"
    src = write_recipe(f'extends: "{base}"   # the 8B base\nname: commented\n', "src/commented.yaml")
    out = tmp_path / "elsewhere" / "deeper" / "c.yaml"
    result = kiln("new", "copied", "--from", src, "--out", out)
    assert result.exit_code == 0, result.output
    assert (out.parent / yaml.safe_load(out.read_text())["extends"]).resolve() == base.resolve()


@pytest.mark.parametrize("name", ["Bad Name", "UPPER", "_under", "a/b", ""])
def test_new_rejects_bad_names(kiln, tmp_path, name):
    out = tmp_path / "x.yaml"
    assert_bad_input(kiln("new", name, "--from", TINY, "--out", out))
    assert not out.exists()


def test_new_reports_unwritable_out(kiln, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_bad_input(kiln("new", "x", "--from", TINY, "--out", blocker / "x.yaml"))


def test_new_from_missing_or_invalid_source(kiln, write_recipe, tmp_path):
    assert_bad_input(kiln("new", "x", "--from", tmp_path / "absent.yaml", "--out", tmp_path / "a.yaml"))
    bad = write_recipe("name: bad\nbild: {}\n")
    assert_bad_input(kiln("new", "x", "--from", bad, "--out", tmp_path / "b.yaml"))
    assert not (tmp_path / "a.yaml").exists() and not (tmp_path / "b.yaml").exists()


# --------------------------------------------------------------------------------------- errors and exit codes


def test_three_mistakes_in_one_run_with_file_line_and_key(kiln, write_recipe):
    path = write_recipe(THREE_MISTAKES)
    result = kiln("validate", path)
    assert_bad_input(result)
    out = result.output
    assert f"{path}:8: error: quantization.calibration.sampels: unknown key" in out
    assert "did you mean `samples`?" in out
    assert f"{path}:13: error: serving.batching: 'inflight' is not allowed" in out
    assert "did you mean `inflight_fused`?" in out
    assert f"{path}:11: error: engine.max_seq_len: max_seq_len (128) is less than max_input_len (512)" in out
    assert "3 problems found" in out


def test_three_mistakes_real_process_prints_no_traceback(write_recipe):
    path = write_recipe(THREE_MISTAKES)
    exe = Path(sys.executable).parent / "kiln"
    proc = subprocess.run([str(exe), "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.count(f"{path}:") == 3 and "3 problems found" in proc.stderr


def test_fp8_on_a100_names_the_sm_and_gpus_that_have_it(kiln):
    result = kiln("validate", FP8, "--set", "hardware.gpu=A100-80GB")
    assert_bad_input(result)
    out = result.output
    assert "FP8 needs SM 89+ but A100-80GB is SM 80" in out
    assert "H100-SXM" in out and "L40S" in out
    assert "FP8 KV cache needs SM 89+" in out
    assert kiln("validate", FP8, "--set", "hardware.gpu=H100-SXM").exit_code == 0


def test_bad_set_value_names_set_as_origin(kiln):
    result = kiln("validate", TINY, "--set", "engine.max_batch_size=lots")
    assert_bad_input(result)
    assert "--set engine.max_batch_size: error: engine.max_batch_size: Input should be a valid integer" in result.output


@pytest.mark.parametrize("item", ["engine.max_batch_size", "=64", "build..max_batch_size=64"])
def test_bad_set_syntax_exits_2(kiln, item):
    result = kiln("validate", TINY, "--set", item)
    assert_bad_input(result)
    assert "bad --set" in result.output and "--set section.key=value" in result.output


def test_strict_turns_warnings_into_exit_2(kiln):
    spec = CONFIGS / "speculative" / "target-llama-3.1-8b.yaml"
    lenient = kiln("validate", spec)
    assert lenient.exit_code == 0, lenient.output
    assert "warning: engine.max_seq_len" in lenient.output and "(1 warning)" in lenient.output
    strict = kiln("validate", spec, "--strict")
    assert_bad_input(strict)
    assert "(--strict)" in strict.output
    # a recipe without warnings passes --strict
    assert kiln("validate", TINY, "--strict").exit_code == 0
    assert kiln("validate", TINY, "--set", "quantization.kv_cache=fp8").exit_code == 0
    assert_bad_input(kiln("validate", TINY, "--set", "quantization.kv_cache=fp8", "--strict"))


@pytest.mark.parametrize("text", ["", "- a list\n", "name: x\nmodel: !!python/object/apply:os.getcwd []\n",
                                  "name: [unclosed\n", "name: ok\nengine: &a {x: *a}\n", "name: !!timestamp x\n",
                                  "name: x\nmodel: " + "[" * 700 + "]" * 700 + "\n"],
                         ids=["empty", "list", "python-tag", "unclosed", "recursive-anchor", "bad-timestamp", "deep"])
def test_malformed_files_exit_2_without_traceback(kiln, write_recipe, text):
    assert_bad_input(kiln("validate", write_recipe(text)))


def test_missing_file_exits_2(kiln, tmp_path):
    result = kiln("validate", tmp_path / "nope.yaml")
    assert_bad_input(result)
    assert "recipe file not found" in result.output


def test_debug_shows_the_traceback(kiln, tmp_path):
    result = kiln("--debug", "validate", tmp_path / "nope.yaml")
    assert result.exit_code == 2
    assert "Traceback" in result.output and "recipe file not found" in result.output


def test_show_reports_errors_like_validate(kiln, write_recipe):
    result = kiln("show", write_recipe(THREE_MISTAKES))
    assert_bad_input(result)
    assert "3 problems found" in result.output


# --------------------------------------------------------------------------------- kiln plan: workloads

WORKLOAD_FIELDS = ["isl", "osl", "concurrency", "batch", "limited_by", "ttft_ms", "tpot_ms", "e2e_ms",
                   "output_tokens_per_s", "output_tokens_per_s_per_gpu"]
TP4 = CONFIGS / "llama-3.1-70b" / "fp8-tp4.yaml"


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    # In-process, stderr (recipe warnings before, "wrote …" after) shares the output with the JSON.
    return json.JSONDecoder().raw_decode(result.output[result.output.index("{\n"):])[0]


def test_plan_workload_json_has_exactly_the_issue_fields_and_the_table_shows_them(kiln):
    from kiln.plan import Workload, plan_for
    from kiln.recipe.loader import load_recipe as load

    # isl ≠ osl, so a swap of the two on the way from the command line to the model shows.
    plan = _json(kiln("plan", TP4, "--isl", "1000", "--osl", "200", "--concurrency", "32", "--json"))
    wl = plan["workload"]
    assert list(wl) == WORKLOAD_FIELDS
    assert (wl["isl"], wl["osl"], wl["concurrency"], wl["batch"], wl["limited_by"]) == (1000, 200, 32, 32,
                                                                                        "concurrency")
    # The figures hang together as the speed basis says, whatever the step times are:
    #   E2E = TTFT + (osl − 1) × TPOT; 32 requests in flight each for E2E (Little's law):
    #   tokens/s = 32 / E2E × osl; per GPU = tokens/s / (tp 4 × pp 1).
    assert wl["e2e_ms"] == pytest.approx(wl["ttft_ms"] + 199 * wl["tpot_ms"], rel=1e-9)
    assert wl["output_tokens_per_s"] == pytest.approx(32 / (wl["e2e_ms"] / 1e3) * 200, rel=1e-9)
    assert wl["output_tokens_per_s_per_gpu"] == pytest.approx(wl["output_tokens_per_s"] / 4, rel=1e-12)
    # ... and they are this workload's, not the swapped one's (which the model predicts differently).
    swapped = plan_for(load(TP4), workload=Workload(200, 1000, 32)).workload
    assert wl["e2e_ms"] != pytest.approx(swapped.e2e_ms, rel=1e-3)
    assert wl["ttft_ms"] != pytest.approx(swapped.ttft_ms, rel=1e-3)
    assert "PyTorch backend" in plan["speed"]["anchors"] and "proxy" in plan["speed"]["anchors"]
    table = " ".join(kiln("plan", TP4, "--isl", "1000", "--osl", "200", "--concurrency", "32").output.split())
    for text in ("Workload: isl 1000, osl 200, concurrency 32", "32 (limited by concurrency",
                 f"TTFT {wl['ttft_ms']:,.1f} ms", f"TPOT {wl['tpot_ms']:,.2f} ms",
                 f"E2E {wl['e2e_ms']:,.0f} ms",
                 f"{wl['output_tokens_per_s']:,.0f} total, {wl['output_tokens_per_s_per_gpu']:,.0f} per GPU",
                 "PyTorch backend"):
        assert text in table, text
    # No workload, no speed section (the memory plan alone, as before).
    assert _json(kiln("plan", TP4, "--json"))["workload"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--isl", "100"], "--isl and --osl go together"),
        (["--concurrency", "4"], "--concurrency needs --isl and --osl"),
        (["--isl", "9000", "--osl", "10"], "isl 9000 exceeds max_input_len 4096"),
        (["--compare", "--isl", "10", "--osl", "10"], "--compare needs two or more recipes or GPUs"),
        (["--compare"], "--compare needs a workload"),
        (["--gpu", "H100-SXM,H200"], "several --gpu values need --compare"),
    ],
)
def test_plan_workload_mistakes_exit_2(kiln, args, message):
    result = kiln("plan", TP4, *args)
    assert_bad_input(result)
    assert message in result.output


def test_plan_compare_writes_a_table_json_and_plot(kiln, tmp_path):
    awq = CONFIGS / "llama-3.1-70b" / "int4-awq-tp2.yaml"
    out = tmp_path / "cmp"
    result = kiln("plan", "--compare", TP4, awq, "--gpu", "H100-SXM,B200", "--isl", "2000", "--osl", "500",
                  "--out", out)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "llama-3.1-70b-fp8-tp4" in text and "llama-3.1-70b-int4-awq-tp2" in text and "PyTorch backend" in text
    data = json.loads((out / "compare.json").read_text())
    assert data["workload"] == {"isl": 2000, "osl": 500, "concurrency": None}
    entries = {(e["recipe"], e["gpu"]): e for e in data["entries"]}
    assert len(entries) == 4
    # INT4 AWQ does not run on B200 (trtllm-build 1.2.1): no figures, the plan's verdict as the reason.
    refused = entries[("llama-3.1-70b-int4-awq-tp2", "B200")]
    assert refused["workload"] is None and refused["reason"].startswith("does not run on B200")
    fp8 = entries[("llama-3.1-70b-fp8-tp4", "H100-SXM")]
    assert list(fp8["workload"]) == WORKLOAD_FIELDS
    assert [w["concurrency"] for w in fp8["curve"]][:3] == [1, 2, 4]
    assert fp8["curve"][-1]["batch"] == fp8["workload"]["batch"]  # the curve ends at the max-throughput batch
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _json(kiln("plan", "--compare", TP4, awq, "--isl", "2000", "--osl", "500", "--out", out,
                      "--json"))["entries"][0]["label"] == "llama-3.1-70b-fp8-tp4"
