"""Triton python-backend model (decoupled): streams N tokens, one per step, for cancelwatch's Triton scenarios.

Loaded by the real tritonserver as `generator` (polls `response_sender.is_cancelled()` every step and
answers CANCELLED), as `generator_deaf` (the same code with `poll_cancel` false: a backend that does
not honour cancellation and keeps running for nobody) and as `generator_hoard` (`keep_on_cancel` true: it
sees the cancel, logs it and stops counting the request active, but keeps the request's buffer: the model's
word and its active gauge say released while its memory stays). Each request holds a buffer while it runs, so
its memory shows in the stub process; the model publishes its own gauges and counters, and logs one
line per request event with the client's request id, so the server's own evidence names the request.

Inputs: N (INT32 [1], tokens to stream), STEP_MS (INT32 [1], optional: step time). Output: TOKEN.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

BUFFER_BYTES = 8 << 20  # per running request: visible in the stub's RSS while it runs


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value") for k, v in cfg.get("parameters", {}).items()}
        self.poll = params.get("poll_cancel", "true") == "true"
        self.default_step_ms = int(params.get("step_ms", "50"))
        self.keep_on_cancel = params.get("keep_on_cancel", "false") == "true"
        self.hoard = []  # generator_hoard: the buffers of cancelled requests, never given back
        self.model = args["model_name"]
        labels = {"model": self.model}
        # the families are kept on self: a Metric whose family is collected fails to update
        self.f_active = pb_utils.MetricFamily(name="cancelwatch_model_active_requests",
                                              description="requests the model is generating for now",
                                              kind=pb_utils.MetricFamily.GAUGE)
        self.f_steps = pb_utils.MetricFamily(name="cancelwatch_model_steps_total",
                                             description="generation steps the model ran",
                                             kind=pb_utils.MetricFamily.COUNTER)
        self.f_cancels = pb_utils.MetricFamily(name="cancelwatch_model_cancels_seen_total",
                                               description="requests the model saw cancelled and stopped",
                                               kind=pb_utils.MetricFamily.COUNTER)
        self.f_buffer = pb_utils.MetricFamily(name="cancelwatch_model_buffer_bytes",
                                              description="bytes held by running requests",
                                              kind=pb_utils.MetricFamily.GAUGE)
        self.active = self.f_active.Metric(labels=labels)
        self.steps = self.f_steps.Metric(labels=labels)
        self.cancels = self.f_cancels.Metric(labels=labels)
        self.buffer = self.f_buffer.Metric(labels=labels)
        self.lock = threading.Lock()
        self.threads = []
        self.log = pb_utils.Logger

    def execute(self, requests):
        for request in requests:
            t = threading.Thread(target=self._generate, args=(request,), daemon=True)
            t.start()
            self.threads.append(t)
        self.threads = [t for t in self.threads if t.is_alive()]
        return None

    def _generate(self, request):
        sender = request.get_response_sender()
        rid = request.request_id()
        n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
        step = pb_utils.get_input_tensor_by_name(request, "STEP_MS")
        step_s = (int(step.as_numpy().reshape(-1)[0]) if step is not None else self.default_step_ms) / 1000.0
        held = np.ones(BUFFER_BYTES // 8, dtype=np.float64)  # touched: resident, not only reserved
        with self.lock:
            self.active.increment(1)
            self.buffer.increment(held.nbytes)
        self.log.log_info(f"cancelwatch model={self.model} request={rid} event=started tokens={n} poll={str(self.poll).lower()}")
        event = "finished"
        try:
            for i in range(n):
                if self.poll and sender.is_cancelled():
                    event = f"cancelled step={i}"
                    with self.lock:
                        self.cancels.increment(1)
                        if self.keep_on_cancel:
                            self.hoard.append(held)
                            self.buffer.increment(held.nbytes)  # the finally's -nbytes leaves it counted
                    error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                    try:  # the model stopped whether or not the answer can still be delivered
                        sender.send(pb_utils.InferenceResponse(error=error),
                                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    except Exception:
                        pass
                    return
                time.sleep(step_s)
                held[i % held.size] += 1.0
                with self.lock:
                    self.steps.increment(1)
                out = pb_utils.Tensor("TOKEN", np.array([i], dtype=np.int32))
                # the last token carries the final flag: a client knows the end by the count it asked for
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == n - 1 else 0
                try:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=flags)
                except Exception:  # the deaf model runs on even when the client is gone
                    pass
            if n <= 0:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            event = f"error {type(exc).__name__}"
        finally:
            with self.lock:
                self.active.increment(-1)
                self.buffer.increment(-held.nbytes)
            del held
            self.log.log_info(f"cancelwatch model={self.model} request={rid} event={event}")

    def finalize(self):
        for t in self.threads:
            t.join(timeout=5)
