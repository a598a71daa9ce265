"""A recording stand-in for Triton's llmapi model (tests/data/llmapi_replay/record.py serves it): every request's
inputs (name, Triton datatype, shape, values), its request id and its requested outputs are appended as one JSON
line to the file the ``record_to`` parameter names; the answer is a fixed text (streamed in two responses when
the request asks to stream). It is a stand-in, named as one: it generates nothing."""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

TYPES = {np.bool_: "BOOL", np.int32: "INT32", np.int64: "INT64", np.uint64: "UINT64", np.float32: "FP32",
         np.float64: "FP64", np.object_: "BYTES", np.bytes_: "BYTES"}


def _values(array):
    if array.dtype == np.object_ or array.dtype.kind == "S":
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    return array.reshape(-1).tolist()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.path = config["parameters"]["record_to"]["string_value"]
        self.inputs = [i["name"] for i in config["input"]]
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            record = {"request_id": request.request_id(), "inputs": {}, "outputs": []}
            for name in self.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is None:
                    continue
                array = tensor.as_numpy()
                record["inputs"][name] = {"datatype": TYPES.get(array.dtype.type, str(array.dtype)),
                                          "shape": list(array.shape), "data": _values(array)}
            try:
                record["outputs"] = sorted(request.requested_output_names())
            except AttributeError:
                record["outputs"] = None
            with self.lock, open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
            sender = request.get_response_sender()
            streaming = "streaming" in record["inputs"] and record["inputs"]["streaming"]["data"][0]
            if streaming:
                sender.send(self._response(["recorded"], record), flags=0)
            sender.send(self._response(["recorded answer"], record),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    @staticmethod
    def _response(text, record):
        tensors = [pb_utils.Tensor("text_output", np.array([t.encode() for t in text], dtype=np.object_))]
        for name in ("finish_reason", "stop_reason"):
            if record["outputs"] and name in record["outputs"]:
                tensors.append(pb_utils.Tensor(name, np.array([b"length"], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=tensors)
