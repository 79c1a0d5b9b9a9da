"""A simulated vLLM fleet: replicas that behave like vLLM from outside (OpenAI API, /metrics,
/tokenize, KV events on ZMQ in vLLM's wire format) over a real tiered prefix cache and a latency
model, cheap enough to run sixteen on two cores. See docs/simulator.md."""
