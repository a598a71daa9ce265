"""Readable tables for a :class:`~kiln.plan.planner.Plan` (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kiln.plan.planner import GIB, Plan
from kiln.plan.result import ANCHOR_NOTE

__all__ = ["render_plan"]


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    return table


def render_plan(plan: Plan, console: Console) -> None:
    """Print ``plan`` as tables: setup, weights, KV cache, limits, decode roofline, verdict and advice."""
    model, gpu, w, kv, lim, ws = plan.model, plan.gpu, plan.weights, plan.kv_cache, plan.limits, plan.workspace

    head = _table("Plan")
    head.add_row("model", f"{model['name']} ({model['params'] / 1e9:.2f} B params, {model['num_layers']} layers, "
                 f"{model['num_heads']} heads / {model['num_kv_heads']} KV heads {model['attention']}, "
                 f"head_dim {model['head_dim']})")
    count = plan.gpu_count if plan.gpu_count is not None else plan.world_size
    head.add_row("GPU", f"{count} × {gpu['name']} (SM {gpu['sm']}, {gpu['memory_gib']:g} GiB, "
                 f"{gpu['bandwidth_gbs']:,.0f} GB/s)")
    head.add_row("parallelism", f"tp {plan.tp} × pp {plan.pp} = {plan.world_size} GPUs per engine, "
                 f"{plan.replicas} replica(s)")
    head.add_row("format", f"{w.format} ({w.quant_algo or 'no quantization'}), base {w.base_dtype}, "
                 f"KV cache {kv.dtype}")
    console.print(head)
    console.print()

    weights = _table("Weights (per GPU unless noted)")
    weights.add_row("bytes per weight", f"{w.bytes_per_weight:g}")
    weights.add_row("whole model", f"{_gib(w.total_bytes)} ({w.quantized_params / 1e9:.2f} B of "
                    f"{w.total_params / 1e9:.2f} B params quantized)")
    for stage in plan.stages:
        label = "per GPU" if len(plan.stages) == 1 else f"stage {stage.stage} (layers {stage.first_layer}–"\
            f"{stage.first_layer + stage.layers - 1})"
        weights.add_row(label, f"{_gib(stage.weights_bytes)} = embedding {_gib(stage.embedding_bytes)} + "
                        f"attention {_gib(stage.attention_bytes)} + MLP {_gib(stage.mlp_bytes)} + "
                        f"lm_head {_gib(stage.lm_head_bytes)} + norms {_mib(stage.norm_bytes)}")
    weights.add_row("excluded", f"{', '.join(w.excluded_matches) or 'nothing'} at {w.base_dtype}"
                    f"{' (lm_head tied to the embedding)' if w.tie_word_embeddings else ''}")
    weights.add_row("workspace", f"{_gib(ws.total_bytes)} = runtime {_gib(ws.runtime_bytes)} + activations "
                    f"{_gib(ws.activation_bytes)} + logits {_gib(ws.logits_bytes)}")
    console.print(weights)
    console.print()

    cache = _table("KV cache (per GPU)")
    cache.add_row("per token", f"{_kib(kv.bytes_per_token_per_gpu)} ({_kib(kv.bytes_per_token)} whole model, "
                  f"{kv.kv_heads_per_gpu} KV head(s) per GPU, {kv.bytes_per_element} byte(s) per element)")
    cache.add_row("per sequence", f"{_mib(kv.bytes_per_sequence_per_gpu)} at max_seq_len "
                  f"({kv.blocks_per_sequence} blocks of {kv.tokens_per_block})")
    cache.add_row("free after weights+workspace", _gib(kv.free_bytes_per_gpu))
    cache.add_row("budget", f"{_gib(kv.budget_bytes_per_gpu)} ({kv.kv_cache_free_gpu_mem_fraction:g} of free"
                  f"; limited by {kv.limited_by})")
    cache.add_row("capacity", f"{kv.tokens:,} tokens in {kv.blocks:,} blocks = {kv.max_sequences:,} "
                  "full-length sequences")
    console.print(cache)
    console.print()

    limits = _table("Limits")
    limits.add_row("concurrent sequences", f"{lim.max_concurrent_sequences:,} at max_seq_len "
                   f"{plan.settings['max_seq_len']} (max_batch_size {lim.max_batch_size}: "
                   f"{'reachable' if lim.batch_reachable else 'not reachable'})")
    pre = lim.prefill
    if pre.seconds is not None:
        limits.add_row("prefill", f"{pre.tokens} tokens in {pre.seconds * 1e3:,.1f} ms "
                       f"({pre.gemm_flops / 1e12:,.2f} TFLOP GEMM + {pre.attention_flops / 1e12:,.2f} TFLOP "
                       f"attention per GPU)")
    else:
        limits.add_row("prefill", "not estimated (no tensor-core figure for this dtype)")
    console.print(limits)

    if lim.decode:
        decode = Table(title=f"Decode roofline (context {lim.decode_context_len} tokens per sequence)",
                       title_justify="left")
        for col in ("batch", "step ms", "tok/s per seq", "tok/s total", "bound"):
            decode.add_column(col, justify="right")
        for point in lim.decode:
            decode.add_row(str(point.batch), f"{point.step_ms:,.2f}", f"{point.tokens_per_s_per_sequence:,.1f}",
                           f"{point.tokens_per_s:,.0f}", point.bound)
        console.print(decode)
    console.print()

    if plan.workload is not None:
        _render_workload(plan, console)

    style = "bold green" if plan.fits and plan.first_limit is None else ("bold yellow" if plan.fits else "bold red")
    console.print(f"[{style}]Verdict:[/] {plan.verdict}")
    for line in plan.advice:
        console.print(f"  • {line}")
    for line in plan.warnings:
        console.print(f"[yellow]warning:[/] {line}")
    console.print("[dim]Estimates from datasheet peaks; see the JSON output (--json) for every basis.[/]")


def _render_workload(plan: Plan, console: Console) -> None:
    """The workload's predicted speed (the same fields as the JSON's ``workload``) and its two kinds of step."""
    w, sp = plan.workload, plan.speed
    assert w is not None and sp is not None
    table = _table(f"Workload: isl {w.isl}, osl {w.osl}, concurrency "
                   f"{w.concurrency if w.concurrency is not None else 'max throughput'}")
    limits = ", ".join(f"{k} {v:,}" for k, v in sp.limits.items())
    table.add_row("batch", f"{w.batch:,} (limited by {w.limited_by}; each limit allows: {limits})")
    table.add_row("TTFT", f"{w.ttft_ms:,.1f} ms ({sp.prompt_steps} prompt step(s)"
                  + (f", {sp.queue_wait_ms:,.0f} ms waiting for a slot" if sp.queue_wait_ms else "") + ")")
    table.add_row("TPOT", f"{w.tpot_ms:,.2f} ms (mean step; {sp.steps_with_prefill:.0%} of steps carry prompt "
                  f"tokens, {sp.prefill_tokens_per_step:,.0f} per step on average)")
    table.add_row("E2E", f"{w.e2e_ms:,.0f} ms")
    table.add_row("output tokens/s", f"{w.output_tokens_per_s:,.0f} total, {w.output_tokens_per_s_per_gpu:,.0f} per "
                  f"GPU ({sp.requests_per_s:,.2f} requests/s)")
    for name, st in (("decode step", sp.decode_step), ("step with prompt", sp.prefill_step)):
        table.add_row(name, f"{st.total_ms:,.2f} ms = GEMM {st.gemm_ms:,.2f} + decode attention "
                      f"{st.decode_attention_ms:,.2f} + prompt attention {st.prefill_attention_ms:,.2f} + "
                      f"communication {st.communication_ms:,.2f} + overhead {st.overhead_ms:,.2f}")
    console.print(table)
    console.print(f"[dim]Speed: {ANCHOR_NOTE}.[/]")
    console.print()
