"""The HTTP surface: the FastAPI app and its raw ASGI routes, the proxy that forwards a request
(streaming, retries before the first byte) through a pooled HTTP/1.1 client, OpenAI-schema
errors, the OpenAPI document, API keys and response ids. It reads the request, asks
``kvroute.router.routing`` where it goes, and forwards; it decides nothing itself."""
