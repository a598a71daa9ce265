"""kiln's evaluate worker: grade the quantizers the quantize worker saved, in the runtime that made them.

    python3 evaluate.py --job JOB.json

It scores kiln's evaluation sequences (token ids, chosen and tokenized by kiln) with one model at a time, spread
over the recipe's GPUs (worker_io.load_model): first the unquantized model — the negative log-likelihood, and each
predicted token's log-probabilities kept in fp16 on the scratch disk (``scratch_dir``) — then, with that model
freed, the same model with the saved quantizers restored (worker_io.restore_quantizer_state): it checks that the
restored model reproduces the calibrated model's probe logits, and sums its negative log-likelihood and the KL
divergence KL(base ‖ quantized) against the stored log-probabilities. Never two copies of the model at once (a 70B
model is ~141 GB per copy). kiln turns the sums into perplexities and the quality gate.

:func:`nll_and_kl` is what kiln's own (host) evaluation uses with both models' logits at hand; :func:`base_pass`
and :func:`quant_pass` split the same figures in two (the base log-probabilities rounded to fp16 in between). The
script imports only torch, transformers, safetensors, modelopt and its sibling worker_io — never kiln.
"""

import json
import os
import time


def nll_and_kl(base_logits, quant_logits, ids, mask):
    """Sums over a batch's predicted tokens: (NLL base, NLL quantized, KL(base ‖ quantized), token count)."""
    import torch

    target = ids[:, 1:]
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    logp_b = torch.log_softmax(base_logits[:, :-1].float(), dim=-1)
    logp_q = torch.log_softmax(quant_logits[:, :-1].float(), dim=-1)
    nll_b = -logp_b.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    nll_q = -logp_q.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    kl = (logp_b.exp() * (logp_b - logp_q)).sum(-1)
    return (float(nll_b[valid].sum()), float(nll_q[valid].sum()), float(kl[valid].sum()), int(valid.sum()))


def _valid(mask):
    return (mask[:, 1:] * mask[:, :-1]).bool()


def base_pass(base_logits, ids, mask):
    """The base model's half of :func:`nll_and_kl`: (NLL sum, the predicted tokens' log-probabilities as fp16,
    one row per valid position)."""
    import torch

    valid = _valid(mask)
    logp_b = torch.log_softmax(base_logits[:, :-1].float(), dim=-1)
    nll_b = -logp_b.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return float(nll_b[valid].sum()), logp_b[valid].to(torch.float16)


def quant_pass(stored_logp_b, quant_logits, ids, mask):
    """The quantized model's half: (NLL sum, KL(base ‖ quantized) sum, token count) against :func:`base_pass`'s
    stored log-probabilities."""
    import torch

    valid = _valid(mask)
    logp_q = torch.log_softmax(quant_logits[:, :-1].float(), dim=-1)
    nll_q = -logp_q.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logp_b = stored_logp_b.to(logp_q.device).float()
    kl = (logp_b.exp() * (logp_b - logp_q[valid])).sum(-1)
    return float(nll_q[valid].sum()), float(kl.sum()), int(valid.sum())


def batches(sequences, batch_size, pad_id):
    import torch

    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, seq in enumerate(chunk):
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        yield ids, mask


def restore_error(model, check_file):
    """Largest logit difference between the restored model and the calibrated one on the saved probe, relative
    to the probe's scale (0 when equal)."""
    import torch
    from safetensors.torch import load_file

    from worker_io import input_device

    probe = load_file(check_file)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"].to(input_device(model)), use_cache=False).logits.float().cpu()
    want = probe["logits"]
    return float((logits - want).abs().max()) / max(1.0, float(want.abs().max()))


def main():
    # A sibling of this script in the runtime; imported here, not above, because kiln imports this file too.
    from worker_io import (device_name, free_memory, input_device, job_from_command_line, load_model,
                           restore_quantizer_state, runtime_device, write_result)

    job = job_from_command_line(__doc__)
    started = time.monotonic()

    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    device = runtime_device()
    with open(job["sequences"], encoding="utf-8") as fh:
        sequences = json.load(fh)
    scratch = job.get("scratch_dir") or os.path.join(os.path.dirname(job["result"]), "base_logprobs")
    os.makedirs(scratch, exist_ok=True)
    try:
        # 1. the unquantized model alone: its NLL, and its log-probabilities on the scratch disk
        model = load_model(job, device)
        nll_b, stored = 0.0, 0
        with torch.no_grad():
            for i, (ids, mask) in enumerate(batches(sequences, job["batch_size"], job["pad_id"])):
                ids, mask = ids.to(input_device(model)), mask.to(input_device(model))
                nll, logp_b = base_pass(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, mask)
                nll_b += nll
                save_file({"logp": logp_b.cpu().contiguous()}, os.path.join(scratch, f"{i}.safetensors"))
                stored += logp_b.numel() * logp_b.element_size()
        model = None
        free_memory()
        # 2. the same checkpoint with the saved quantizers, once the first is gone
        model = restore_quantizer_state(load_model(job, device), job["modelopt_state"])
        error = restore_error(model, job["restore_check"])
        if error > 1e-3:
            raise SystemExit(f"the restored quantized model does not reproduce the calibrated one (relative logit "
                             f"difference {error:.3g}): the quantize output is damaged")
        nll_q, kl, tokens = 0.0, 0.0, 0
        with torch.no_grad():
            for i, (ids, mask) in enumerate(batches(sequences, job["batch_size"], job["pad_id"])):
                ids, mask = ids.to(input_device(model)), mask.to(input_device(model))
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                q, k, n = quant_pass(load_file(os.path.join(scratch, f"{i}.safetensors"))["logp"], logits, ids, mask)
                nll_q, kl, tokens = nll_q + q, kl + k, tokens + n
        model = None
        free_memory()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_result(job, {"nll_base": nll_b, "nll_quant": nll_q, "kl": kl, "tokens": tokens,
                       "restore_error": error, "device": device_name(device), "models_at_once": 1,
                       "base_logprob_bytes": stored, "seconds": round(time.monotonic() - started, 3)})


if __name__ == "__main__":
    main()
