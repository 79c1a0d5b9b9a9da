"""P/D through the endpoint picker: a prefill and a decode endpoint, the way llm-d does it.

Behind a gateway the router forwards nothing, so it cannot drive the two legs itself
(router/serving/disagg.py). llm-d's inference scheduler splits P/D with a sidecar in front
of each decode pod instead: the picker names the decode pod as the destination
(``x-gateway-destination-endpoint``) and the prefill pod in a request header,
``x-prefiller-host-port: <ip:port>``; the sidecar reads and removes that header, runs the
prefill leg on the named pod, then the decode leg on its own vLLM; without the header it
serves the request whole (llm-d/llm-d-inference-scheduler at 520af478:
``pkg/common/routing/common.go`` ``PrefillEndpointHeader``,
``pkg/epp/framework/plugins/scheduling/profilehandler/disagg/disagg_headers_handler.go``,
which deletes the header before setting it, and ``pkg/sidecar/proxy/chat_completions.go``).

kvroute's picker speaks that protocol with its own decider (router/routing/disagg.py): the
decode endpoint is the pick over the decode pool, as for any request; the decider says
whether the prefill leg pays (or is skipped: a returning user whose history the decode
replica holds in any tier, a short prompt, a loaded prefill pool) and which prefill
replica, ranked by kvroute's cost within the gateway's subset hint. A split commits the
prefill replica's decision (blocks in progress, no home) and its answer's cached tokens are
the prefill's (vLLM's decode replica reports them as its own): accuracy compares them with
the prefill replica's prediction, as the proxy does.

The picker commits its decode pick before the decider is asked, and the destination is
that pick: the decider's third choice, the whole request on a prefill replica, is not
offered here (``on_prefill=False``); such a request is served whole on the decode pick.

A client's own ``x-prefiller-host-port`` never reaches the sidecar: the picker removes it
from every request it does not split (it would name any host to send the prompt to).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.router.epp.messages import replica_endpoint
from kvroute.router.fleet.replicas import Replica
from kvroute.router.routing.disagg import PdPlan, pools
from kvroute.router.routing.router import Decision
from kvroute.router.serving.disagg import SPLIT_KINDS, has_prefill_pool
from kvroute.router.tokens.requests import ParsedRequest

if TYPE_CHECKING:  # the composition root imports the picker
    from kvroute.router.service import RouterService

__all__ = ["PREFILL_ENDPOINT_HEADER", "plan_prefill"]

# llm-d's routing.PrefillEndpointHeader: the prefill pod's <ip:port>, read by the sidecar.
PREFILL_ENDPOINT_HEADER = "x-prefiller-host-port"


async def plan_prefill(
    service: RouterService,
    kind: str,
    parsed: ParsedRequest,
    decision: Decision,
    session: str | None,
    subset: set[str] | None,
) -> PdPlan | None:
    """The P/D plan of a picked request (``decision``: its decode ranking), or None when
    the fleet has no prefill replica or the endpoint is not one vLLM splits. A split
    commits the prefill pick and marks the decode decision as fed by a remote prefill."""
    if kind not in SPLIT_KINDS or not has_prefill_pool(service.registry):
        return None
    limit = service.settings.max_pending_per_replica
    pool = [
        r
        for r in pools(service.candidates(parsed.model))[1]
        if (not limit or r.pending < limit) and (subset is None or replica_endpoint(r) in subset)
    ]

    async def rank(replicas: list[Replica]) -> Decision:
        return await service.router.decide(parsed, replicas, session)

    plan = await service.disagg.decide(decision, parsed, pool, rank, on_prefill=False)
    if plan.split and plan.prefill_decision is not None:
        service.router.commit(plan.prefill_decision, plan.prefill[0], home=False)
        decision.remote_prefill = True  # its first byte timed the pull, not its own work
    return plan
