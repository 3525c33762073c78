"""lockstep's OpenAI-compatible server driven by the official `openai` Python SDK.

Run by the Rust test `crates/server/tests/server/openai_sdk.rs`, which starts a server with
qwen2.5-coder-0.5b and sets OPENAI_BASE_URL / OPENAI_API_KEY / LOCKSTEP_MODEL. Every check
raises on failure (no skipping); the script prints one line per passed check.
"""

import json
import os
import re
import sys

import openai

MODEL = os.environ["LOCKSTEP_MODEL"]
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name} failed: {detail}")
    print(f"ok - {name}")


def test_models():
    ids = [m.id for m in client.models.list().data]
    check("models.list", MODEL in ids, ids)


def test_chat():
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    check("chat content", bool(r.choices[0].message.content), r)
    check("chat usage", r.usage.completion_tokens >= 1 and r.usage.total_tokens > r.usage.completion_tokens, r.usage)
    check("chat fingerprint", r.system_fingerprint.startswith("lockstep-"), r.system_fingerprint)
    return r.choices[0].message.content


def test_stream(expected):
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
    check("stream text equals non-stream", text == expected, (text, expected))
    check("stream usage chunk", usage is not None and usage.completion_tokens >= 1, usage)


def test_tools_required():
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    calls = r.choices[0].message.tool_calls
    check("tools required: finish_reason", r.choices[0].finish_reason == "tool_calls", r)
    check("tools required: a call", calls and calls[0].function.name == "get_weather", r)
    args = json.loads(calls[0].function.arguments)
    check("tools required: arguments", isinstance(args.get("city"), str) and set(args) == {"city"}, args)


def test_tools_auto():
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Use the get_weather tool to get the weather in Rome."}],
        tools=[WEATHER],
        tool_choice="auto",
        temperature=0,
        max_tokens=60,
    )
    msg = r.choices[0].message
    if msg.tool_calls:
        args = json.loads(msg.tool_calls[0].function.arguments)
        check("tools auto: valid call", isinstance(args.get("city"), str), args)
    else:
        check("tools auto: text answer", bool(msg.content), r)


def test_json_schema():
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
        temperature=0,
        max_tokens=60,
    )
    data = json.loads(r.choices[0].message.content)
    check("json_schema output", isinstance(data["name"], str) and isinstance(data["age"], int) and set(data) == {"name", "age"}, data)


def test_responses_custom_tool():
    grammar = 'start: "ls " PATH\nPATH: /[a-z\\/]{1,20}/\n'
    r = client.responses.create(
        model=MODEL,
        input="List the files in /tmp.",
        tools=[{"type": "custom", "name": "shell", "description": "Run a shell command",
                "format": {"type": "grammar", "syntax": "lark", "definition": grammar}}],
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
    )
    calls = [o for o in r.output if o.type == "custom_tool_call"]
    check("responses custom tool call", len(calls) >= 1 and calls[0].name == "shell", r.output)
    check("custom tool input in the grammar", re.fullmatch(r"ls [a-z/]{1,20}", calls[0].input) is not None, calls[0].input)
    events = [e.type for e in client.responses.create(
        model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0, stream=True)]
    check("responses stream events", events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete"), events)


def test_errors():
    # Clients send their own model names: the one served model answers them.
    r = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    check("another model name is answered by the served model", r.model == MODEL, r.model)
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}], max_tokens=1)
    except openai.BadRequestError as e:
        check("an unknown role is BadRequestError", e.status_code == 400 and "role" in str(e))
    else:
        raise AssertionError("role wizard was accepted")
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=7)
    except openai.BadRequestError as e:
        check("bad temperature is BadRequestError", e.status_code == 400 and "temperature" in str(e))
    else:
        raise AssertionError("temperature 7 was accepted")


def main():
    test_models()
    expected = test_chat()
    test_stream(expected)
    test_tools_required()
    test_tools_auto()
    test_json_schema()
    test_responses_custom_tool()
    test_errors()
    print("all openai SDK checks passed")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001 - report and fail loudly
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
