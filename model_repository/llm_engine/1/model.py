"""Triton adapter: tensors <-> plain Python; the work is `pagedllm.serving.engine_model`."""

import os
import site
import sys

# The stub embeds Python in isolated mode (PYTHONPATH is ignored): the launcher lists the
# environment's site directories in PAGEDLLM_SYS_PATH; they go ahead of the system's.
_before = list(sys.path)
for _p in os.environ.get("PAGEDLLM_SYS_PATH", "").split(os.pathsep):
    if _p:
        site.addsitedir(_p)
sys.path[:] = [p for p in sys.path if p not in _before] + _before

import json  # noqa: E402

import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.serving.engine_model import EngineModel, engine_config  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _gauges(labels):
    """vLLM's gauge names on Triton's metrics port, set from the engine thread."""
    families, gauges = [], {}  # a family must outlive its metrics
    for name, doc in (
        ("vllm:num_requests_running", "Requests in the running batch."),
        ("vllm:num_requests_waiting", "Requests waiting to be scheduled."),
        ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all)."),
    ):
        family = pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.GAUGE)
        families.append(family)
        gauges[name] = family.Metric(labels=labels)

    def on_stats(stats):
        gauges["vllm:num_requests_running"].set(stats.num_running)
        gauges["vllm:num_requests_waiting"].set(stats.num_waiting)
        gauges["vllm:kv_cache_usage_perc"].set(stats.kv_blocks_used / stats.kv_blocks_total)

    on_stats.families = families
    return on_stats


def _finished_counter(labels):
    """vllm:request_success_total by finished_reason (stop, length, abort)."""
    family = pb_utils.MetricFamily(
        name="vllm:request_success_total",
        description="Finished requests, by finish reason.",
        kind=pb_utils.MetricFamily.COUNTER,
    )
    counters = {}

    def on_finish(reason):
        if reason not in counters:
            counters[reason] = family.Metric(labels={**labels, "finished_reason": reason})
        counters[reason].increment(1)

    on_finish.family = family
    return on_finish


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.model = EngineModel(
            engine_config(params), on_stats=_gauges(labels), on_finish=_finished_counter(labels)
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            abort = pb_utils.get_input_tensor_by_name(request, "abort_request_id")
            if abort is not None:  # from the detokenizer: the ensemble's client cancelled
                self.model.abort(abort.as_numpy().reshape(-1)[0].decode())
                sender.send(flags=FINAL)
                continue

            def get(name, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            def send(tensors, final, sender=sender):
                response = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()]
                )
                sender.send(response, flags=FINAL if final else 0)

            def fail(message, sender=sender):
                error = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
                sender.send(error, flags=FINAL)

            self.model.handle(get, send, fail, sender.is_cancelled)
        return None

    def finalize(self):
        self.model.shutdown()
