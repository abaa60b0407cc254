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

import contextlib  # noqa: E402
import locale  # noqa: E402

# Isolated mode also leaves the C locale, so files opened without an encoding are read as
# ASCII (torch.compile's inductor, for one, reads UTF-8 templates that way: "'ascii' codec
# can't decode byte 0xe2"). Python's own startup coerces the C locale to UTF-8 (PEP 538);
# so does this model.
with contextlib.suppress(locale.Error):  # no such locale here: keep the default
    locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

import json  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

import triton_python_backend_utils as pb_utils  # noqa: E402

from pagedllm.convert import to_bool  # noqa: E402
from pagedllm.serving import adapter  # noqa: E402
from pagedllm.serving.lora import lora_modules  # noqa: E402
from pagedllm.serving.metrics import (  # noqa: E402
    CACHE_CONFIG_INFO,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    INFO,
    REJECTED,
    MetricsExporter,
    cache_config_info,
)
from pagedllm.serving.settings import (  # noqa: E402
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_MAX_QUEUED_REQUESTS,
    engine_config,
    instance_device,
    instance_gpus,
    int_setting,
    set_visible_gpus,
    setting,
    tensor_parallel_size,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Metrics:
    """vLLM-named metrics on Triton's metrics port (`pagedllm.serving.metrics`). Every update
    is a message to the server, one per token for the inter-token histogram: they are applied
    on their own thread, off the engine's."""

    def __init__(self, labels):
        self.queue = queue.SimpleQueue()
        threading.Thread(target=self._apply, name="pagedllm-metrics", daemon=True).start()
        self.labels = labels
        self.exporter = MetricsExporter()
        kinds = pb_utils.MetricFamily
        self.families = {}  # a family must outlive its metrics
        for names, kind in ((COUNTERS, kinds.COUNTER), (GAUGES | INFO, kinds.GAUGE)):
            for name, doc in names.items():
                self.families[name] = kinds(name=name, description=doc, kind=kind)
        for name, (doc, _) in HISTOGRAMS.items():
            self.families[name] = kinds(name=name, description=doc, kind=kinds.HISTOGRAM)
        self.metrics = {}

    def _metric(self, name, labels):
        key = (name, labels)
        if key not in self.metrics:
            family, all_labels = self.families[name], {**self.labels, **dict(labels)}
            if name in HISTOGRAMS:
                buckets = list(HISTOGRAMS[name][1])
                self.metrics[key] = family.Metric(labels=all_labels, buckets=buckets)
            else:
                self.metrics[key] = family.Metric(labels=all_labels)
        return self.metrics[key]

    def __call__(self, stats, observations):
        self.queue.put((stats, observations))

    def rejected(self):
        self.queue.put(None)

    def info(self, name, labels):
        """An info gauge: 1, the facts in its labels."""
        self.queue.put((name, tuple(labels.items())))

    def _apply(self):
        while True:
            item = self.queue.get()
            if item is None:
                self._metric(REJECTED, (("reason", "queue_full"),)).increment(1)
            elif isinstance(item[0], str):
                self._metric(*item).set(1)
            else:
                self._update(*item)

    def _update(self, stats, observations):
        for u in self.exporter.updates(stats, observations):
            metric = self._metric(u.name, u.labels)
            if u.kind == "counter":
                metric.increment(u.value)
            elif u.kind == "gauge":
                metric.set(u.value)
            else:
                metric.observe(u.value)


def _stopping(drain_file):
    """When to drain: once `drain_file` exists (`pagedllm serve` creates it before it stops
    the server; docker/serve.sh and a Kubernetes preStop hook can too). An unload drains in
    `finalize`. NOTE: not `pb_utils.is_model_ready` from the sender thread: that IPC, beside
    the main thread's, can crash tritonserver 2.51 (boost lock_exception in the backend)."""
    return lambda: bool(drain_file) and os.path.exists(drain_file)


def _stop_server(reason):
    """A poisoned engine refuses every request; Triton 2.51 gives a Python model no way to
    mark itself unready (a dead stub even leaves it "ready"), so the server is stopped: it
    turns unready at once, drains, and exits, and its supervisor (compose, Kubernetes)
    starts a fresh one — what vLLM's server does when its engine dies."""
    logging.error("llm_engine: the engine is dead (%s): stopping tritonserver", reason)
    os.kill(os.getppid(), signal.SIGTERM)


def _senders(sender):
    def send(tensors, final):
        sender.send(adapter.response(pb_utils, tensors), flags=FINAL if final else 0)

    def fail(message, code):
        sender.send(adapter.error(pb_utils, message, code), flags=FINAL)

    return send, fail


class TritonPythonModel:
    def initialize(self, args):
        # our INFO lines (a cancelled request, as vllm_backend logs it) reach the server log
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        logging.getLogger("pagedllm").setLevel(logging.INFO)
        params = adapter.parameters(args)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        metrics = to_bool("metrics", setting(params, "metrics", "true"))
        kind = args["model_instance_kind"]
        tensor_parallel_size(params, kind)  # KIND_GPU with tensor_parallel_size > 1: refused
        groups = json.loads(args["model_config"]).get("instance_group", [])
        gpus = instance_gpus(params, args["model_instance_name"], groups)
        if gpus is not None:  # before CUDA starts: this process and its workers see only these
            set_visible_gpus(gpus)
        device = instance_device(params, kind, int(args["model_instance_device_id"]))
        self.embeddings = None
        if setting(params, "runner", "generate") == "pooling":  # embeddings only
            from pagedllm.serving.embedding_model import EmbeddingModel

            self.embeddings = EmbeddingModel(engine_config(params, device))
            return
        exporter = _Metrics(labels) if metrics else None
        # NOTE: imported here, not at the top: Triton also runs this file in a stub of its own
        # to complete the config, where torch (3 s of CPU) would be imported for nothing
        from pagedllm.serving.engine_model import EngineModel

        self.model = EngineModel(
            engine_config(params, device),
            on_stats=exporter,
            trace_file=setting(params, "trace_file") or None,
            max_queued_requests=int_setting(
                params, "max_queued_requests", DEFAULT_MAX_QUEUED_REQUESTS
            ),
            on_rejected=exporter.rejected if exporter else None,
            on_dead=_stop_server
            if to_bool("exit_on_engine_failure", setting(params, "exit_on_engine_failure", "true"))
            else None,
            fault_injection=setting(params, "fault_injection"),
            stopping=_stopping(setting(params, "drain_file")),
            drain_timeout=float(setting(params, "drain_timeout_s", str(DEFAULT_DRAIN_TIMEOUT))),
            # vllm_backend's multi_lora.json beside this file, and the lora_modules setting
            lora_modules=lora_modules(
                params, os.path.join(args["model_repository"], args["model_version"])
            ),
        )
        if exporter:
            engine = self.model.engine
            blocks = engine.stats().kv_blocks_total
            exporter.info(CACHE_CONFIG_INFO, cache_config_info(engine.config, blocks))

    def execute(self, requests):
        if self.embeddings is not None:
            for request in requests:
                send, fail = _senders(request.get_response_sender())
                self.embeddings.handle(adapter.getter(pb_utils, request), send, fail)
            return None
        for request in requests:
            sender = request.get_response_sender()
            abort = pb_utils.get_input_tensor_by_name(request, "abort_request_id")
            if abort is not None:  # the ensemble's client cancelled (from the detokenizer)
                # harmless from anyone else: the id is the request's 128-bit random key
                # (docs/serving.md, threat model); the answer says nothing about it
                key = abort.as_numpy().reshape(-1)
                if key.size == 1 and isinstance(key[0], bytes):
                    self.model.abort(key[0].decode("utf-8", "replace"))
                sender.send(flags=FINAL)
                continue

            admin = pb_utils.get_input_tensor_by_name(request, "lora_admin")
            if admin is not None:  # the OpenAI gateway's adapter routes (serving.lora_admin)
                answer = self.model.lora_admin(admin.as_numpy())
                sender.send(adapter.response(pb_utils, answer), flags=FINAL)
                continue
            send, fail = _senders(sender)
            get = adapter.getter(pb_utils, request)
            # vllm_backend's second place for sampling parameters and lora_name
            self.model.handle(get, send, fail, sender.is_cancelled, request.parameters())
        return None

    def finalize(self):
        if self.embeddings is not None:
            self.embeddings.shutdown()
            return
        self.model.drain()  # unloaded: those in flight get drain_timeout_s, then are aborted
        self.model.shutdown()
