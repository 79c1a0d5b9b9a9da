"""Router to router: the load each peer is proxying now (streamed), index snapshots for a
warm start, and the warm start itself. Several routers agree on caches through the events
and on load through these."""
