"""kvroute's router: an OpenAI-compatible proxy that sends each request to the vLLM replica
expected to answer it first, given what each replica already holds in its KV cache."""
