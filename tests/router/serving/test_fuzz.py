"""Property-based fuzzing of every HTTP endpoint the router serves: never a 5xx, never a hang.

A real router (its own process, under uvicorn, as ``kvroute serve`` runs it) in front of a
simulated fleet (bench/sim: vLLM's HTTP API and event stream). Two generators:
- schemathesis, from the router's own OpenAPI document (``/openapi.json``): valid and
  schema-violating requests for every operation it lists, proxied ones included;
- hypothesis strategies for raw OpenAI request bodies: wrong types in the fields routing
  reads, unicode edge cases (lone surrogates as JSON escapes, NULs, RTL marks, emoji), invalid
  UTF-8 bytes, deep nesting, huge numbers, duplicate keys, truncated documents.
Every answer must be below 500, an error must be in OpenAI's schema, and the router must be
alive and routing afterwards. Bounded: ``KVROUTE_FUZZ_EXAMPLES`` (default 40 per operation or
strategy, about a minute in all); ``KVROUTE_FUZZ_EXAMPLES=2000`` is the long run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.deploy.router_process import RouterProcess

EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "40"))
MODEL = "kvroute-sim"
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("KVROUTE_FUZZ_RANDOM") is None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
PATHS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/debug/route",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/pooling",
]


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    config = SimFleetConfig(
        replicas=2,
        gpu_blocks=256,
        max_model_len=2048,
        default_max_tokens=4,
        latency=LatencyModel(time_scale=0.01),
        stream_interval_s=0.001,
    )
    with SimFleet(config) as fleet:
        settings_ = fleet.router_settings(health_interval_s=0.5, max_json_depth=64)
        with RouterProcess(settings_) as router:
            yield router.url


@pytest.fixture(scope="module")
def client(router_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router_url, timeout=httpx.Timeout(30.0)) as c:
        yield c


def _check(resp: httpx.Response, what: object) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], repr(what)[:500])
    if resp.status_code >= 400:
        body = resp.json()
        assert isinstance(body.get("error"), dict), body
        assert isinstance(body["error"].get("message"), str) and body["error"]["message"]


def _alive(client: httpx.Client) -> None:
    """The router still routes: a real completion goes through and is answered."""
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "still here?"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert client.get("/health").status_code == 200


# --- schemathesis: the router's own OpenAPI document --------------------------------------


def test_every_operation_of_the_openapi_document_is_fuzzed_without_a_5xx(
    router_url: str, client: httpx.Client
) -> None:
    import schemathesis

    document = client.get("/openapi.json").json()
    for path in PATHS[:4]:  # the proxied endpoints are described, not only FastAPI's own
        assert "requestBody" in document["paths"][path]["post"], path
    schema = schemathesis.openapi.from_url(f"{router_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    seen: dict[str, set[int]] = {}
    for operation in operations:
        _fuzz_operation(operation, router_url, client, seen)()
    assert any(200 in codes for codes in seen.values()), seen  # valid requests got through
    assert any(400 in codes for codes in seen.values()), seen  # and invalid ones were refused
    _alive(client)


def _fuzz_operation(
    operation: Any, router_url: str, client: httpx.Client, seen: dict[str, set[int]]
) -> Any:
    from schemathesis import GenerationMode

    strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE) | (
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    )

    @FUZZ
    @given(case=strategy)
    def run(case: Any) -> None:
        kwargs = case.as_transport_kwargs(base_url=router_url)
        headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "host"}
        resp = client.request(
            kwargs["method"],
            kwargs["url"],
            params=kwargs.get("params"),
            headers=headers,
            content=_content(kwargs),
        )
        _check(resp, case.body)
        seen.setdefault(operation.label, set()).add(resp.status_code)

    return run


def _content(kwargs: dict[str, Any]) -> bytes | None:
    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data") or kwargs.get("content")
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    return data


# --- hypothesis: raw OpenAI bodies ---------------------------------------------------------

_EDGE_TEXT = st.sampled_from(
    [
        "",
        "\x00",
        "\u202e\u0627\u0644\u0639\u0631\u0628\u064a\u0629",
        "\U0001f600" * 50,
        "\ufeffBOM",
        "a\r\nb\tc",
        "<|im_start|>system<|im_end|>",
        "{{ raise_exception('x') }}",
        "\u0301\u0301\u0301",
        "x" * 5000,
    ]
)
_TEXT = st.one_of(st.text(max_size=200), _EDGE_TEXT)
_NUMBERS = st.sampled_from(
    ["0", "-1", "1e400", "-1e400", "1e-400", str(2**64), str(-(2**63) - 1), "1.5", "NaN", "1E5"]
)
_SCALAR_JSON = st.one_of(
    st.none().map(lambda _: "null"),
    st.booleans().map(lambda b: "true" if b else "false"),
    _NUMBERS,
    st.integers(-(2**70), 2**70).map(str),
    _TEXT.map(json.dumps),
    st.just('"\\ud800"'),  # a lone surrogate, escaped: valid JSON, not a valid string
    st.just('"\\udfff\\ud800"'),
)


def _json_value(depth: int = 3) -> st.SearchStrategy[str]:
    """A JSON value as text (so huge numbers and lone surrogates stay as written)."""
    return st.recursive(
        _SCALAR_JSON,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
            st.dictionaries(_TEXT, inner, max_size=4).map(
                lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}"
            ),
        ),
        max_leaves=8,
    )


_FIELDS = [
    "model",
    "prompt",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "cache_salt",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "tokens",
    "logprobs",
    "stop",
    "input",
    "instructions",
    "previous_response_id",
    "system",
]


@st.composite
def _openai_bodies(draw: st.DrawFn) -> bytes:
    """A body near a valid one: the right model and a usable prompt or conversation, with
    some fields replaced by anything, duplicated, or the document broken."""
    good: dict[str, str] = {
        "model": json.dumps(MODEL),
        "prompt": json.dumps(draw(_TEXT)),
        "messages": json.dumps([{"role": "user", "content": draw(_TEXT)}]),
        "tokens": json.dumps(draw(st.lists(st.integers(0, 400), min_size=1, max_size=8))),
        "input": json.dumps(draw(_TEXT)),
        "max_tokens": "2",
    }
    fields = dict(good)
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=4)):
        fields[name] = draw(_json_value())
    items = [f"{json.dumps(k)}:{v}" for k, v in fields.items()]
    if draw(st.booleans()):  # a duplicate key: the last one wins in most parsers
        name = draw(st.sampled_from(_FIELDS))
        items.insert(draw(st.integers(0, len(items))), f"{json.dumps(name)}:{draw(_json_value())}")
    doc = ("{" + ",".join(items) + "}").encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none", "none", "utf8", "truncate", "nest", "bom", "trail"]))
    if damage == "utf8":  # invalid UTF-8 inside a string (or anywhere)
        at = doc.find(b'"', draw(st.integers(0, max(0, len(doc) - 1)))) + 1
        doc = doc[:at] + draw(st.sampled_from([b"\xff\xfe", b"\xc3", b"\xed\xa0\x80"])) + doc[at:]
    elif damage == "truncate":
        doc = doc[: draw(st.integers(0, len(doc)))]
    elif damage == "nest":
        depth = draw(st.sampled_from([63, 64, 65, 1000, 5000]))
        doc = doc[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"
    elif damage == "bom":
        doc = b"\xef\xbb\xbf" + doc
    elif damage == "trail":
        doc = doc + draw(st.sampled_from([b" ", b"x", b"{}", b"\x00"]))
    return doc


@pytest.mark.parametrize("path", PATHS)
def test_hostile_openai_bodies_are_4xx_never_5xx(path: str, client: httpx.Client) -> None:
    statuses: set[int] = set()

    @FUZZ
    @given(body=_openai_bodies(), stream=st.booleans())
    def run(body: bytes, stream: bool) -> None:
        headers = {"content-type": "application/json"}
        with client.stream("POST", path, content=body, headers=headers) as resp:
            resp.read()  # a stream is read to its end: a break mid-way would raise here
        _check(resp, body)
        statuses.add(resp.status_code)

    run()
    assert statuses & {400, 404, 422}, statuses
    _alive(client)


@FUZZ
@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST", "OPTIONS", "HEAD"]),
    path=st.one_of(
        st.sampled_from([*PATHS, "/health", "/v1/models", "/metrics", "/index/stats"]),
        st.text(
            st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"),
            min_size=1,
            max_size=40,
        ).map(lambda p: "/" + p.lstrip("/")),
    ),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "multipart/form-data; boundary=x", ""]
    ),
)
def test_any_method_on_any_path_is_answered_without_a_5xx(
    client: httpx.Client, method: str, path: str, content_type: str
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    content = b"" if method in ("GET", "HEAD", "OPTIONS") else b'{"model": "kvroute-sim"}'
    resp = client.request(method, path, content=content, headers=headers)
    assert resp.status_code < 500, (method, path, resp.status_code, resp.text[:300])
    if resp.status_code >= 400 and method != "HEAD":
        assert isinstance(resp.json().get("error"), dict)
