"""Triton Python model ``postprocessing``: token ids in, text out (upstream inflight_batcher_llm contract).

kiln copies this file into generated repositories as ``postprocessing/1/model.py``, with
``kiln_triton_utils.py`` beside it (the only other module it imports from kiln's source; it must not import kiln).

Inputs: ``TOKENS_BATCH`` INT32[-1,-1] (so ``[batch, beams, tokens]``), optional ``SEQUENCE_LENGTH``
INT32[-1] (``[batch, beams]``: how many of each row's tokens are real; the rest is padding). Output:
``OUTPUT`` BYTES[-1], shaped as upstream's model returns it at runtime: one flat array of ``batch × beams``
UTF-8 strings (batch item 0's beams first), so clients read ``text_output[0]`` as bytes.

Parameters: ``tokenizer_dir`` (required; holds ``tokenizer.json``), ``skip_special_tokens`` (default true).

Streaming. Each response of a streaming request reaches this model as its own request carrying only that
response's new tokens, with nothing tying it to the ones before: this model is stateless, as upstream's is,
and the ensemble streams what it returns: per-response deltas. Text stays correct because the chunks are cut
where the text is whole: kiln's reference ``tensorrt_llm`` model never ends a streamed chunk inside a UTF-8
character (byte-level BPE can spread one character over several tokens), so decoding each chunk on its own
and concatenating the pieces gives the same text as decoding the whole sequence, for byte-level tokenizers.
TensorRT-LLM's backend cuts chunks per token, so through the ensemble a character split across tokens comes
out as U+FFFD pieces, and tokenizers whose decoder strips a leading space (SentencePiece "▁") lose that space
at chunk starts, exactly as upstream. The ``tensorrt_llm_bls`` model decodes the whole sequence each time
(``decode_delta`` below is that computation), which is correct for every tokenizer and target.
"""

from kiln_triton_utils import use_utf8_locale

use_utf8_locale()

import json  # noqa: E402
import os  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from kiln_triton_utils import (  # noqa: E402
    RequestError,
    get_bool_param,
    get_param,
    last_error_line,
    resolve_path,
    text_delta,
)
from tokenizers import Tokenizer  # noqa: E402


def decode_rows(tokenizer, tokens, lengths, skip_special_tokens):
    """Decode ``tokens`` [batch, beams, n] cut to ``lengths`` [batch, beams] into a [batch, beams] list of str."""
    tokens = np.asarray(tokens)
    if tokens.ndim == 2:  # [batch, n]: one beam
        tokens = tokens[:, None, :]
    if tokens.ndim != 3:
        raise RequestError(f"TOKENS_BATCH must be [batch, beams, tokens], got shape {tokens.shape}")
    if lengths is None:
        lengths = np.full(tokens.shape[:2], tokens.shape[2], dtype=np.int64)
    lengths = np.asarray(lengths).reshape(tokens.shape[0], -1)
    if lengths.shape[1] != tokens.shape[1]:
        raise RequestError(f"SEQUENCE_LENGTH shape {lengths.shape} does not match TOKENS_BATCH {tokens.shape}")
    texts = []
    for b in range(tokens.shape[0]):
        row = []
        for k in range(tokens.shape[1]):
            n = int(min(max(lengths[b, k], 0), tokens.shape[2]))
            ids = [int(t) for t in tokens[b, k, :n] if t >= 0]
            row.append(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        texts.append(row)
    return texts


def decode_delta(tokenizer, ids, sent_chars, skip_special_tokens, final):
    """Incremental detokenization: (new_text, new_sent_chars) for the token list ``ids`` decoded so far.

    Decodes the whole sequence and returns what follows the ``sent_chars`` characters already sent. While
    the text ends in U+FFFD (a UTF-8 character whose bytes are still arriving) the tail is held back,
    unless ``final``.
    """
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
    return text_delta(text, sent_chars, final)


class TritonPythonModel:
    """Detokenizer step of the ensemble (and of tensorrt_llm_bls)."""

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        tokenizer_dir = get_param(self.model_config, "tokenizer_dir")
        if tokenizer_dir is None:
            raise ValueError(
                "postprocessing: parameter 'tokenizer_dir' is not set in config.pbtxt "
                "(missing, empty or an unfilled ${...})"
            )
        tokenizer_dir = resolve_path(args, tokenizer_dir)
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"postprocessing: {path} not found (tokenizer_dir must hold a tokenizer.json)")
        self.tokenizer = Tokenizer.from_file(path)
        self.skip_special_tokens = get_bool_param(self.model_config, "skip_special_tokens", True)
        out = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT")
        self.output_dtype = pb_utils.triton_string_to_numpy(out["data_type"]) if out else np.object_
        pb_utils.Logger.log_info(f"postprocessing: tokenizer {path}, skip_special_tokens {self.skip_special_tokens}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH")
                if tokens is None:
                    raise RequestError("TOKENS_BATCH is missing")
                lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH")
                texts = decode_rows(
                    self.tokenizer,
                    tokens.as_numpy(),
                    None if lengths is None else lengths.as_numpy(),
                    self.skip_special_tokens,
                )
                data = np.array([t.encode("utf-8") for row in texts for t in row], dtype=self.output_dtype)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", data)]))
            except RequestError as err:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err))))
            except Exception:  # never let one request take the model down
                pb_utils.Logger.log_error(f"postprocessing: {traceback.format_exc()}")
                msg = f"postprocessing failed: {last_error_line()}"
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg)))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("postprocessing: finalized")
