"""The soak's load: client threads that each send one random plan at a time over its protocol,
judge the reply by the oracle and record it; and the requests still in flight at the end."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

from pagedllm.serving.tritonserver import TritonServer

from .grpc_client import GrpcClient
from .http_clients import Http, gateway, triton_http
from .oracle import FAMILY, Oracle
from .plans import Plan, Reply, Spec, pick


@dataclass
class Record:
    protocol: str
    kind: str
    bad: str
    outcome: str
    seconds: float
    detail: str = ""


class Soak:
    """The server, the gateway and the clients' shared state (records, oracle)."""

    def __init__(self, server: TritonServer, gateway_port: int, model: str, timeout: float):
        self.server = server
        self.triton_http = Http(server.http_port)
        self.gateway_http = Http(gateway_port)
        self.model = model
        self.timeout = timeout
        self.oracle = Oracle(timeout)
        self.records: list[Record] = []
        self.in_flight: dict[int, tuple[Plan, float]] = {}  # by worker: its request, since
        self.lock = threading.Lock()

    def send(self, plan: Plan, grpc: GrpcClient) -> Reply:
        p = plan.protocol
        if p.startswith("openai"):
            return gateway(self.gateway_http, plan, p, self.model, self.timeout)
        if p == "grpc_infer_llm":
            return grpc.infer(plan, self.timeout)
        if p.startswith("grpc_stream"):
            return grpc.stream(plan, p == "grpc_stream", self.timeout)
        return triton_http(self.triton_http, plan, p, self.timeout)

    def run_one(self, plan: Plan, grpc: GrpcClient) -> Record:
        start = time.monotonic()
        try:
            reply = self.send(plan, grpc)
        except Exception as e:  # a broken answer (bad JSON, missing field): the server's fault
            reply = Reply.broken(e)
        outcome, detail = self.oracle.classify(plan, reply)
        seconds = time.monotonic() - start
        record = Record(plan.protocol, plan.kind, plan.bad, outcome, seconds, detail)
        with self.lock:
            self.records.append(record)
        return record

    def make_oracle(self, specs: list[Spec]) -> None:
        with contextlib.closing(GrpcClient(self.server.grpc_url)) as grpc:
            self.oracle.build(specs, lambda plan: self.send(plan, grpc))

    def warm_up(self, spec: Spec) -> None:
        """Every path once (lazy set-up along each), not recorded."""
        with contextlib.closing(GrpcClient(self.server.grpc_url)) as grpc:
            for protocol in FAMILY:
                self.send(Plan(protocol, "good", spec), grpc)

    def outcomes(self) -> Counter[str]:
        with self.lock:
            return Counter(r.outcome for r in self.records)

    def worker(self, seed: int, specs: list[Spec], stop: threading.Event) -> None:
        rng = random.Random(seed)
        with contextlib.closing(GrpcClient(self.server.grpc_url)) as grpc:
            while not stop.is_set():
                plan = pick(rng, specs)
                self.in_flight[seed] = (plan, time.monotonic())
                self.run_one(plan, grpc)
                del self.in_flight[seed]

    def stuck(self, seconds: float) -> list[Record]:
        """The requests in flight for longer than `seconds` (as `hung` records): a client
        blocked where no timeout reaches (e.g. tritonclient's stop_stream, which waits for
        the server to close the stream)."""
        now = time.monotonic()
        return [
            Record(plan.protocol, plan.kind, plan.bad, "hung", now - t, f"{plan}: still running")
            for plan, t in list(self.in_flight.values())
            if now - t > seconds
        ]
