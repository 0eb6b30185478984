"""The gateway's Prometheus families, in a registry of its own per app (tests run several gateways in one process).
Label values are bounded: endpoints, HTTP status codes, worker addresses (the configured fleet), routing reasons."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragcore.metrics import LATENCY_BUCKETS, _NoCreated


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    ttft: Histogram
    routed: Counter
    inflight: Gauge
    serving: Gauge
    tokens: Counter
    exported: CollectorRegistry  # what /metrics serves: the families without their `_created` samples
    _children: dict = field(default_factory=dict)

    def child(self, family: Counter | Histogram | Gauge, *values: str):
        """family.labels(*values), remembered: a dict lookup per request instead of prometheus' checks and lock
        (label values are bounded, see above; the gateway updates its metrics from its one event loop)."""
        key = (family, values)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = family.labels(*values)
        return got

    @classmethod
    def create(cls) -> "GatewayMetrics":
        r = CollectorRegistry(auto_describe=True)
        exported = CollectorRegistry(auto_describe=True)
        exported.register(_NoCreated(r))
        return cls(exported=exported,
            registry=r,
            requests=Counter("ragserve_gateway_requests", "HTTP requests by endpoint and status",
                             ["endpoint", "status"], registry=r),
            latency=Histogram("ragserve_gateway_request_seconds", "whole request time", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r),
            ttft=Histogram("ragserve_gateway_ttft_seconds", "time to the first streamed token", ["endpoint"],
                           buckets=LATENCY_BUCKETS, registry=r),
            routed=Counter("ragserve_gateway_routed", "worker calls by worker and why it was chosen "
                           "(affinity | least_loaded | retry)", ["worker", "reason"], registry=r),
            inflight=Gauge("ragserve_gateway_worker_inflight", "calls in flight per worker", ["worker"], registry=r),
            serving=Gauge("ragserve_gateway_worker_serving", "1 while the worker's health says SERVING", ["worker"],
                          registry=r),
            tokens=Counter("ragserve_gateway_completion_tokens", "completion tokens returned", registry=r),
        )
