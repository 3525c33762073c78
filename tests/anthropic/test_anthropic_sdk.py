"""lockstep's Anthropic Messages API driven by the official `anthropic` Python SDK.

Run by the Rust test `crates/server/tests/server/anthropic_sdk.rs`, which starts a server
with qwen2.5-coder-0.5b and sets ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY / LOCKSTEP_MODEL.
Every check raises on failure (no skipping); the script prints one line per passed check.
The SDK's `create` no longer takes sampling parameters: `temperature` goes in `extra_body`
(greedy decoding makes the streamed and plain replies comparable).
"""

import json
import os

import anthropic

MODEL = os.environ["LOCKSTEP_MODEL"]
# Clients send their own model names: the one served model answers them.
ASKED = "claude-sonnet-4-5"
client = anthropic.Anthropic(
    base_url=os.environ["ANTHROPIC_BASE_URL"],
    api_key=os.environ["ANTHROPIC_API_KEY"],
    max_retries=0,
)

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


# Long enough to fill whole KV blocks (32 tokens), so a repeated prompt hits the prefix cache.
SYSTEM = (
    "You are terse. Answer in a few words and never more than one sentence. Do not explain, "
    "do not apologise, do not ask questions back, and do not use lists or markdown."
)


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name} failed: {detail}")
    print(f"ok - {name}")


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain():
    r = client.messages.create(
        model=ASKED,
        max_tokens=16,
        extra_body={"temperature": 0},
        system=SYSTEM,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    check("plain: a message", r.type == "message" and r.role == "assistant", r)
    check("plain: names the served model", r.model == MODEL, r.model)
    check("plain: text", bool(text_of(r).strip()), r)
    check("plain: stop_reason", r.stop_reason in ("end_turn", "max_tokens"), r.stop_reason)
    check("plain: usage", r.usage.output_tokens >= 1 and r.usage.input_tokens >= 1, r.usage)
    return r


def test_stream(expected):
    events = []
    with client.messages.stream(
        model=ASKED,
        max_tokens=16,
        extra_body={"temperature": 0},
        system=SYSTEM,
        messages=[{"role": "user", "content": "Say hello."}],
    ) as stream:
        for e in stream:
            events.append(e.type)
        final = stream.get_final_message()
    check("stream: starts with message_start", events[0] == "message_start", events)
    check("stream: ends with message_stop", events[-1] == "message_stop", events)
    for kind in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        check(f"stream: has {kind}", kind in events, events)
    check("stream: same text as the plain call", text_of(final) == text_of(expected), (final, expected))
    check("stream: same stop_reason", final.stop_reason == expected.stop_reason, final)
    check("stream: usage", final.usage.output_tokens == expected.usage.output_tokens, final.usage)
    # The prompt was seen before: the prefix cache served part of it.
    check(
        "stream: cached prompt tokens",
        final.usage.cache_read_input_tokens >= 1
        and final.usage.input_tokens + final.usage.cache_read_input_tokens
        == expected.usage.input_tokens + expected.usage.cache_read_input_tokens,
        final.usage,
    )


def test_tool_round_trip():
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    r = client.messages.create(
        model=ASKED,
        max_tokens=64,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        # A 0.5B model under "auto" often writes the call as plain JSON: ask for a call.
        tool_choice={"type": "any"},
        messages=messages,
    )
    uses = [b for b in r.content if b.type == "tool_use"]
    check("tool: a tool_use block", len(uses) >= 1 and r.stop_reason == "tool_use", r)
    use = uses[0]
    check("tool: input follows the schema", isinstance(use.input.get("city"), str) and set(use.input) == {"city"}, use)
    check("tool: id", use.id.startswith("toolu_"), use.id)
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "Sunny, 24 C"}]}
            ],
        }
    )
    r2 = client.messages.create(
        model=ASKED,
        max_tokens=48,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=messages,
    )
    check("tool: an answer after the result", bool(text_of(r2).strip()), r2)
    check("tool: no call after tool_choice none", all(b.type == "text" for b in r2.content), r2)


def test_forced_tool():
    r = client.messages.create(
        model=ASKED,
        max_tokens=64,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Tell me a joke."}],
    )
    uses = [b for b in r.content if b.type == "tool_use"]
    check("forced: exactly one call", len(uses) == 1 and uses[0].name == "get_weather", r)
    check("forced: stop_reason tool_use", r.stop_reason == "tool_use", r.stop_reason)
    check("forced: input follows the schema", isinstance(uses[0].input.get("city"), str), uses[0])
    # The same forced call streamed: the input arrives as input_json_delta pieces.
    partial = {}
    with client.messages.stream(
        model=ASKED,
        max_tokens=64,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Tell me a joke."}],
    ) as stream:
        for e in stream:
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                partial[e.index] = partial.get(e.index, "") + e.delta.partial_json
        final = stream.get_final_message()
    uses = [(i, b) for i, b in enumerate(final.content) if b.type == "tool_use"]
    check("forced stream: tool_use blocks", len(uses) >= 1 and final.stop_reason == "tool_use", final)
    for i, use in uses:
        check(
            f"forced stream: block {i}'s input_json_delta pieces add up to its input",
            json.loads(partial[i]) == use.input and isinstance(use.input.get("city"), str),
            (partial, use),
        )


def test_stop_sequences():
    r = client.messages.create(
        model=ASKED,
        max_tokens=64,
        extra_body={"temperature": 0},
        stop_sequences=["3"],
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by spaces."}],
    )
    check("stop: stop_reason", r.stop_reason == "stop_sequence", r)
    check("stop: the sequence", r.stop_sequence == "3", r.stop_sequence)
    check("stop: text ends before it", "3" not in text_of(r), text_of(r))


def test_count_tokens():
    n = client.messages.count_tokens(
        model=ASKED,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    with_tools = client.messages.count_tokens(
        model=ASKED,
        system=SYSTEM,
        tools=[WEATHER],
        messages=[{"role": "user", "content": "Say hello."}],
    )
    check("count_tokens: positive", n.input_tokens > 3, n)
    check("count_tokens: tools count", with_tools.input_tokens > n.input_tokens, (n, with_tools))
    # The same prompt run: its usage adds up to the count.
    r = client.messages.create(
        model=ASKED,
        max_tokens=1,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    check(
        "count_tokens: matches usage",
        r.usage.input_tokens + r.usage.cache_read_input_tokens == n.input_tokens,
        (r.usage, n),
    )


def expect_400(name, body):
    try:
        client.post("/v1/messages", cast_to=object, body=body)
    except anthropic.BadRequestError as e:
        check(f"400: {name}", e.status_code == 400, e)
        err = e.body["error"]
        check(f"400: {name} has Anthropic's body", e.body["type"] == "error" and err["type"] == "invalid_request_error", e.body)
        return err["message"]
    raise AssertionError(f"400: {name}: no error")


def test_bad_requests():
    msgs = [{"role": "user", "content": "hi"}]
    m = expect_400("missing max_tokens", {"model": ASKED, "messages": msgs})
    check("400: names max_tokens", "max_tokens" in m, m)
    m = expect_400(
        "unknown block type",
        {"model": ASKED, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
    )
    check("400: names the block type", "hologram" in m, m)
    m = expect_400(
        "malformed tool_result",
        {
            "model": ASKED,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "content": 42}]}],
        },
    )
    check("400: names the tool_result field", "tool_use_id" in m, m)
    expect_400("unknown role", {"model": ASKED, "max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}]})
    # Still serving.
    r = client.messages.create(model=ASKED, max_tokens=2, messages=msgs)
    check("still serving after 400s", r.usage.output_tokens >= 1, r)


def test_headers():
    r = client.messages.create(
        model=ASKED,
        max_tokens=2,
        messages=[{"role": "user", "content": "hi"}],
        metadata={"user_id": "someone"},
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31", "anthropic-version": "2023-06-01"},
    )
    check("anthropic-beta and metadata accepted", r.type == "message", r)


if __name__ == "__main__":
    first = test_plain()
    test_stream(first)
    test_tool_round_trip()
    test_forced_tool()
    test_stop_sequences()
    test_count_tokens()
    test_bad_requests()
    test_headers()
    print("all anthropic SDK checks passed")
