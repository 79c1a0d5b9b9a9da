"""The Gateway API Inference Extension endpoint picker (``--epp-port``): a second front end that
answers Envoy's ext_proc stream with the replica the router would have chosen, through the same
decision path as the proxied requests."""
