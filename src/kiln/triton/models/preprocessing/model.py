"""Triton Python model ``preprocessing``: text in, token ids out (upstream inflight_batcher_llm contract).

kiln copies this file into generated repositories as ``preprocessing/1/model.py``, with
``kiln_triton_utils.py`` beside it (the only other module it imports from kiln's source; it must not import kiln).

Inputs (``max_batch_size`` > 0, so each is ``[batch, ...]``): every input of upstream's preprocessing config.
``QUERY`` BYTES[1] and ``REQUEST_OUTPUT_LEN`` INT32[1] are required; optional ``DECODER_QUERY`` BYTES[1],
``BAD_WORDS_DICT``/``STOP_WORDS_DICT`` BYTES[-1], ``EMBEDDING_BIAS_WORDS`` BYTES[-1] with
``EMBEDDING_BIAS_WEIGHTS`` FP32[-1], ``END_ID``/``PAD_ID`` INT32[1], ``PROMPT_TABLE_EXTRA_ID`` UINT64[1]. The
image and video inputs (``IMAGE_BYTES``, ``IMAGE_URL``, ``IMAGE_SIZES``, ``VIDEO_BYTES``) are accepted by the
config and refused with an error naming them: kiln serves text-only models.

Outputs, as upstream's model returns them (only those declared in config.pbtxt are sent): ``INPUT_ID``
INT32[-1] (padded with the pad id), ``REQUEST_INPUT_LEN`` INT32[1], ``DECODER_INPUT_ID`` INT32[-1] /
``REQUEST_DECODER_INPUT_LEN`` INT32[1] (``DECODER_QUERY`` tokenized; without it one pad token and length 1,
which is what upstream sends for decoder-only models and what ``tensorrt_llm`` ignores for them),
``BAD_WORDS_IDS``/``STOP_WORDS_IDS`` INT32[2,-1] (row 0: the words' ids concatenated, row 1: their end offsets,
padded with 0 / -1), ``EMBEDDING_BIAS`` FP32[-1] (the weights summed per token id over the vocabulary; empty
``[batch, 0]`` without bias words), ``REQUEST_OUTPUT_LEN`` INT32[-1], ``OUT_END_ID``/``OUT_PAD_ID`` INT32[1],
and ``OUT_PROMPT_TABLE_EXTRA_IDS`` UINT64[-1] only when ``PROMPT_TABLE_EXTRA_ID`` is sent (the extra id at
prompt-table positions, ids >= the vocabulary size, else 0). The vision outputs are never produced.

Parameters (config.pbtxt ``parameters``, all strings): ``tokenizer_dir`` (required; holds
``tokenizer.json``), ``add_special_tokens`` (default true), ``max_input_len`` (prompt tokens, optional),
``max_seq_len`` (prompt + output tokens, optional), ``max_output_len`` (optional).

Tokenization uses ``tokenizers.Tokenizer`` (not transformers' AutoTokenizer, which imports torch: seconds
and hundreds of MB per stub, for identical ids). A bad request gets an error response naming the problem;
the model keeps serving.
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
    get_int_param,
    get_param,
    input_array,
    last_error_line,
    refuse_unsupported,
    resolve_path,
)
from tokenizers import Tokenizer  # noqa: E402

#: Without max_seq_len / max_output_len, a max_tokens above this is refused as a client error.
ABSURD_OUTPUT_LEN = 1 << 20
#: Upstream inputs kiln's preprocessing accepts in its config but cannot act on: (rule, message).
UNSUPPORTED = {
    name: ("nonempty", f"{what} is not supported: kiln serves text-only models (no multimodal preprocessing)")
    for name, what in (("IMAGE_BYTES", "image input"), ("IMAGE_URL", "image input"), ("IMAGE_SIZES", "image input"),
                       ("VIDEO_BYTES", "video input"))
}


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def _token_name(value):
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value):
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


def special_token_ids(tokenizer_dir, tokenizer):
    """(end_id, pad_id) from tokenizer_config.json, else generation_config.json / config.json; pad defaults to end."""
    tok_cfg = _read_json(os.path.join(tokenizer_dir, "tokenizer_config.json"))
    end_id = pad_id = None
    name = _token_name(tok_cfg.get("eos_token"))
    if name is not None:
        end_id = tokenizer.token_to_id(name)
    name = _token_name(tok_cfg.get("pad_token"))
    if name is not None:
        pad_id = tokenizer.token_to_id(name)
    for fname in ("generation_config.json", "config.json"):
        cfg = _read_json(os.path.join(tokenizer_dir, fname))
        end_id = end_id if end_id is not None else _first_id(cfg.get("eos_token_id"))
        pad_id = pad_id if pad_id is not None else _first_id(cfg.get("pad_token_id"))
    if end_id is None:
        raise ValueError(
            f"no end-of-sequence token found in {tokenizer_dir}: set eos_token in tokenizer_config.json or "
            "eos_token_id in config.json / generation_config.json"
        )
    return int(end_id), int(end_id if pad_id is None else pad_id)


def word_list_ids(tokenizer, rows, batch_size):
    """Encode per-item word lists to the [batch, 2, L] INT32 layout of ``stop_words_list``/``bad_words_list``.

    Row 0 holds every word's token ids back to back (padded with 0), row 1 the end offset of each word
    (padded with -1). ``rows`` is None (no words: shape [batch, 2, 0]) or an array [batch, n] of bytes.
    """
    if rows is None:
        return np.zeros((batch_size, 2, 0), dtype=np.int32)
    flat, offsets = [], []
    for row in rows:
        ids, ends = [], []
        for word in np.asarray(row).reshape(-1):
            text = word.decode("utf-8") if isinstance(word, bytes) else str(word)
            if text == "":
                continue
            word_ids = tokenizer.encode(text, add_special_tokens=False).ids
            if not word_ids:
                continue
            ids.extend(word_ids)
            ends.append(len(ids))
        flat.append(ids)
        offsets.append(ends)
    width = max([1] + [len(ids) for ids in flat])
    out = np.zeros((len(flat), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, (ids, ends) in enumerate(zip(flat, offsets)):
        out[i, 0, : len(ids)] = ids
        out[i, 1, : len(ends)] = ends
    return out


def _per_item(array, batch_size, name):
    """Values of a [batch, 1] (or [batch]) input as a list of batch_size ints."""
    flat = np.asarray(array).reshape(-1)
    if flat.size == 1 and batch_size > 1:
        flat = np.repeat(flat, batch_size)
    if flat.size != batch_size:
        raise RequestError(f"{name} must hold one value per batch item ({batch_size}), got shape {array.shape}")
    return [int(v) for v in flat]


class TritonPythonModel:
    """Tokenizer step of the ensemble (and of tensorrt_llm_bls)."""

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        cfg = self.model_config
        tokenizer_dir = get_param(cfg, "tokenizer_dir")
        if tokenizer_dir is None:
            raise ValueError(
                "preprocessing: parameter 'tokenizer_dir' is not set in config.pbtxt "
                "(missing, empty or an unfilled ${...})"
            )
        tokenizer_dir = resolve_path(args, tokenizer_dir)
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"preprocessing: {path} not found (tokenizer_dir must hold a tokenizer.json)")
        self.tokenizer = Tokenizer.from_file(path)
        # A tokenizer.json may carry truncation/padding settings: prompts are never cut silently here, an
        # over-long prompt gets an error naming max_input_len instead.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.add_special_tokens = get_bool_param(cfg, "add_special_tokens", True)
        self.max_input_len = get_int_param(cfg, "max_input_len", None)
        self.max_seq_len = get_int_param(cfg, "max_seq_len", None)
        self.max_output_len = get_int_param(cfg, "max_output_len", None)
        self.end_id, self.pad_id = special_token_ids(tokenizer_dir, self.tokenizer)
        self.output_dtypes = {
            out["name"]: pb_utils.triton_string_to_numpy(out["data_type"]) for out in cfg.get("output", [])
        }
        pb_utils.Logger.log_info(
            f"preprocessing: tokenizer {path} (vocab {self.tokenizer.get_vocab_size()}), end_id {self.end_id}, "
            f"pad_id {self.pad_id}, add_special_tokens {self.add_special_tokens}"
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._outputs(request)))
            except RequestError as err:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err))))
            except Exception:  # never let one request take the model down
                pb_utils.Logger.log_error(f"preprocessing: {traceback.format_exc()}")
                msg = f"preprocessing failed: {last_error_line()}"
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg)))
        return responses

    # ------------------------------------------------------------------ request handling
    @staticmethod
    def _texts(rows, what):
        texts = []
        for item in rows.reshape(rows.shape[0], -1):
            if item.size == 0:
                raise RequestError(f"{what} is empty")
            raw = item[0]
            try:
                text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            except UnicodeDecodeError:
                raise RequestError(f"{what} is not valid UTF-8") from None
            if text == "":
                raise RequestError(f"{what} is empty: send the prompt text")
            texts.append(text)
        return texts

    def _padded(self, ids, pad_ids):
        width = max(len(p) for p in ids)
        out = np.empty((len(ids), width), dtype=np.int32)
        for i, seq in enumerate(ids):
            out[i, :] = pad_ids[i]
            out[i, : len(seq)] = seq
        return out

    def _embedding_bias(self, request, batch):
        """[batch, vocab] FP32: each bias word's weight added at each of its token ids (upstream's layout)."""
        words, weights = input_array(request, "EMBEDDING_BIAS_WORDS"), input_array(request, "EMBEDDING_BIAS_WEIGHTS")
        if words is None and weights is None:
            return np.zeros((batch, 0), dtype=np.float32)
        if words is None or weights is None:
            raise RequestError("embedding_bias_words and embedding_bias_weights must be sent together")
        words, weights = words.reshape(words.shape[0], -1), weights.reshape(weights.shape[0], -1)
        if words.shape != weights.shape:
            raise RequestError(
                f"embedding_bias_words {words.shape} and embedding_bias_weights {weights.shape} must have the same shape"
            )
        if words.shape[0] == 1 and batch > 1:
            words, weights = np.repeat(words, batch, axis=0), np.repeat(weights, batch, axis=0)
        bias = np.zeros((batch, self.tokenizer.get_vocab_size()), dtype=np.float32)
        for b in range(batch):
            for word, weight in zip(words[b], weights[b]):
                text = word.decode("utf-8") if isinstance(word, bytes) else str(word)
                for token in self.tokenizer.encode(text, add_special_tokens=False).ids if text else []:
                    bias[b, token] += float(weight)
        return bias

    def _outputs(self, request):
        refuse_unsupported(request, UNSUPPORTED)
        query = input_array(request, "QUERY")
        if query is None:
            raise RequestError("text_input (QUERY) is missing")
        texts = self._texts(query, "text_input")
        batch = len(texts)
        out_len_in = input_array(request, "REQUEST_OUTPUT_LEN")
        if out_len_in is None:
            raise RequestError("max_tokens (REQUEST_OUTPUT_LEN) is missing")
        out_lens = _per_item(out_len_in, batch, "max_tokens")
        ids = [self.tokenizer.encode(t, add_special_tokens=self.add_special_tokens).ids for t in texts]
        for i, (prompt, max_tokens) in enumerate(zip(ids, out_lens)):
            self._validate(i, len(prompt), max_tokens)

        end_in, pad_in = input_array(request, "END_ID"), input_array(request, "PAD_ID")
        end_ids = _per_item(end_in, batch, "end_id") if end_in is not None else [self.end_id] * batch
        pad_ids = _per_item(pad_in, batch, "pad_id") if pad_in is not None else [self.pad_id] * batch

        input_ids = self._padded(ids, pad_ids)
        decoder = input_array(request, "DECODER_QUERY")
        if decoder is not None:
            decoder_texts = self._texts(decoder, "decoder_text_input")
            if len(decoder_texts) != batch:
                raise RequestError(f"decoder_text_input has {len(decoder_texts)} items for {batch} prompts")
            decoder_ids = [self.tokenizer.encode(t, add_special_tokens=self.add_special_tokens).ids
                           for t in decoder_texts]
        else:  # decoder-only models: one pad token, as upstream sends (tensorrt_llm ignores it for them)
            decoder_ids = [[p] for p in pad_ids]
        values = {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": np.array([[len(p)] for p in ids], dtype=np.int32),
            "DECODER_INPUT_ID": self._padded(decoder_ids, pad_ids),
            "REQUEST_DECODER_INPUT_LEN": np.array([[len(d)] for d in decoder_ids], dtype=np.int32),
            "REQUEST_OUTPUT_LEN": np.array([[n] for n in out_lens], dtype=np.int32),
            "BAD_WORDS_IDS": word_list_ids(self.tokenizer, input_array(request, "BAD_WORDS_DICT"), batch),
            "STOP_WORDS_IDS": word_list_ids(self.tokenizer, input_array(request, "STOP_WORDS_DICT"), batch),
            "EMBEDDING_BIAS": self._embedding_bias(request, batch),
            "OUT_END_ID": np.array([[e] for e in end_ids], dtype=np.int32),
            "OUT_PAD_ID": np.array([[p] for p in pad_ids], dtype=np.int32),
        }
        extra = input_array(request, "PROMPT_TABLE_EXTRA_ID")
        if extra is not None:  # only then, as upstream: the id at prompt-table positions (ids >= vocabulary)
            extra = np.asarray(extra).reshape(-1)
            if extra.size != batch:
                raise RequestError(f"prompt_table_extra_id must hold one value per prompt ({batch}), got {extra.size}")
            vocab = self.tokenizer.get_vocab_size()
            values["OUT_PROMPT_TABLE_EXTRA_IDS"] = np.where(input_ids >= vocab, extra[:, None], 0).astype(np.uint64)
        return [
            pb_utils.Tensor(name, values[name].astype(dtype))
            for name, dtype in self.output_dtypes.items()
            if name in values
        ]

    def _validate(self, index, prompt_len, max_tokens):
        where = f" (batch item {index})" if index else ""
        if prompt_len == 0:
            raise RequestError(f"text_input{where} encodes to no tokens")
        if max_tokens < 1:
            raise RequestError(f"max_tokens{where} must be at least 1, got {max_tokens}")
        if self.max_input_len is not None and prompt_len > self.max_input_len:
            raise RequestError(
                f"prompt{where} is {prompt_len} tokens, more than this model's max_input_len of "
                f"{self.max_input_len}; shorten it"
            )
        if self.max_output_len is not None and max_tokens > self.max_output_len:
            raise RequestError(
                f"max_tokens{where} is {max_tokens}, more than this model's max_output_len of {self.max_output_len}"
            )
        if self.max_seq_len is not None and prompt_len + max_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}){where} exceeds this model's "
                f"max_seq_len of {self.max_seq_len}; ask for at most {max(self.max_seq_len - prompt_len, 0)} tokens"
            )
        if max_tokens > ABSURD_OUTPUT_LEN:
            raise RequestError(f"max_tokens{where} is {max_tokens}: more than {ABSURD_OUTPUT_LEN} is not served")

    def finalize(self):
        pb_utils.Logger.log_info("preprocessing: finalized")
