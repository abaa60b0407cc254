"""The pieces of `benchmarks/soak.py` (its docstring describes the soak):

- `plans`: what is asked (prompt specs, one request's plan, the protocol mix) and how a plan
  is written for Triton and for the gateway;
- `bad_inputs`: the malformed requests, each a change to a good one;
- `grpc_client`, `http_clients`: one client per protocol, each returning a `Reply`;
- `oracle`: the expected greedy texts and the verdict on each reply;
- `load`: the client threads and the records of what they sent;
- `resources`: RSS, fds and threads of tritonserver, its stubs and the gateway (from /proc);
- `run`: the set-up (tiny model, gateway) and one soak from start to rest;
- `report`: the JSON report and its checks.
"""
