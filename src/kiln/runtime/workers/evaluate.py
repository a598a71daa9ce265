"""kiln's evaluate worker: grade the quantizers the quantize worker saved, in the runtime that made them.

    python3 evaluate.py --job JOB.json

It loads the unquantized model twice, restores the saved ModelOpt state (``modelopt.torch.opt.restore``) onto
one, checks that the restored model reproduces the calibrated model's probe logits, and sums over kiln's
evaluation sequences (token ids, chosen and tokenized by kiln) the negative log-likelihood of both models and
the KL divergence KL(base ‖ quantized). kiln turns the sums into perplexities and the quality gate.

:func:`nll_and_kl` is also what kiln's own (host) evaluation uses, so both paths compute the same figures. The
script imports only torch, transformers, safetensors, modelopt and its sibling worker_io — never kiln.
"""

import json
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

    probe = load_file(check_file)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"].to(device), use_cache=False).logits.float().cpu()
    want = probe["logits"]
    return float((logits - want).abs().max()) / max(1.0, float(want.abs().max()))


def main():
    # A sibling of this script in the runtime; imported here, not above, because kiln imports this file too.
    from worker_io import device_name, job_from_command_line, load_model, runtime_device, write_result

    job = job_from_command_line(__doc__)
    started = time.monotonic()

    import modelopt.torch.opt as mto
    import torch

    device = runtime_device()
    base = load_model(job, device)
    quant = mto.restore(load_model(job, device), job["modelopt_state"]).eval()
    error = restore_error(quant, job["restore_check"])
    if error > 1e-3:
        raise SystemExit(f"the restored quantized model does not reproduce the calibrated one (relative logit "
                         f"difference {error:.3g}): the quantize output is damaged")
    with open(job["sequences"], encoding="utf-8") as fh:
        sequences = json.load(fh)
    sums = [0.0, 0.0, 0.0, 0]
    with torch.no_grad():
        for ids, mask in batches(sequences, job["batch_size"], job["pad_id"]):
            ids, mask = ids.to(device), mask.to(device)
            lb = base(input_ids=ids, attention_mask=mask, use_cache=False).logits
            lq = quant(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for i, value in enumerate(nll_and_kl(lb, lq, ids, mask)):
                sums[i] += value
    write_result(job, {"nll_base": sums[0], "nll_quant": sums[1], "kl": sums[2], "tokens": sums[3],
                       "restore_error": error, "device": device_name(device),
                       "seconds": round(time.monotonic() - started, 3)})


if __name__ == "__main__":
    main()
