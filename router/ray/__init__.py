"""kvroute inside Ray Serve: a request router Ray Serve loads by name, and an ``LLMServer``
subclass whose replicas publish their KV events where that router finds them.

``request_router.py`` (``KVRouteRequestRouter``) and ``server.py`` (``KVRouteLLMServer``)
import Ray; ``fleet.py`` (the index, feeds, tokenizer and policy of one router) and
``endpoints.py`` (what a replica advertises) do not, so they are tested without it. Ray is
the ``kvroute[ray]`` extra: nothing outside this package imports it (docs/deploy.md, "Ray
Serve").
"""
