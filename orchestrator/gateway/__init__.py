"""The request path: the gateway's HTTP server, OpenAI routes, admission and tenants, placement
of requests on pool replicas, the flows (unified, prefill/decode) and the relay of replies.

The rest of `orchestrator/` is the control plane; this package runs in every ingress replica.
"""
