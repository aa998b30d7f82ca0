"""Triton python-backend model (unary, dynamic batching, one instance): each execution sleeps, so
requests behind it wait in the core's queue, where the core drops a cancelled one (reported as
`nv_inference_request_failure{reason="CANCELED"}`). While executing it polls `request.is_cancelled()`.

Input: MS (INT32 [1], how long the execution takes). Output: DONE (INT32 [1]).
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

POLL_S = 0.02


class TritonPythonModel:
    def initialize(self, args):
        self.model = args["model_name"]
        self.log = pb_utils.Logger
        # kept on self: a Metric whose family is collected fails to update
        self.f_active = pb_utils.MetricFamily(name="cancelwatch_model_active_requests",
                                              description="requests the model is executing now",
                                              kind=pb_utils.MetricFamily.GAUGE)
        self.active = self.f_active.Metric(labels={"model": self.model})

    def execute(self, requests):
        out = []
        for request in requests:
            rid = request.request_id()
            ms = int(pb_utils.get_input_tensor_by_name(request, "MS").as_numpy().reshape(-1)[0])
            self.log.log_info(f"cancelwatch model={self.model} request={rid} event=started ms={ms} poll=true")
            self.active.increment(1)
            end = time.monotonic() + ms / 1000.0
            cancelled = False
            while time.monotonic() < end:
                if request.is_cancelled():
                    cancelled = True
                    break
                time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))
            self.active.increment(-1)
            if cancelled:
                self.log.log_info(f"cancelwatch model={self.model} request={rid} event=cancelled")
                out.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)))
            else:
                self.log.log_info(f"cancelwatch model={self.model} request={rid} event=finished")
                out.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("DONE", np.array([ms], dtype=np.int32))]))
        return out
