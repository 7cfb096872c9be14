"""The OpenAI API's other shapes, as the chat completions the policy endpoint serves.

The endpoint (``turnrl.envs.endpoint``) answers every model call of an agent as one chat
completion of its episode (``turnrl.envs.agent``), which is where token-exactness is kept.
This module translates, with no I/O, the two other shapes agents use:

- The **Responses API** (``POST .../responses``, the OpenAI Agents SDK's default model).
  ``chat_request`` turns a request into the chat request it stands for: ``instructions``
  become the system message, ``input`` items become messages (a ``function_call`` is an
  assistant message's tool call, a ``function_call_output`` a tool message), the
  conversation of ``previous_response_id`` goes first, and function tools take the chat
  form. ``response_object`` turns the chat completion back into a response (a
  ``message`` item for text, a ``function_call`` item per tool call). The two are inverse
  on what the endpoint returns: an agent that sends a response's output items back as
  input sends the very messages the chat path would, so the episode stays one sample,
  token for token, exactly as through chat completions.
- **Streaming** (``stream: true``) of both APIs: ``chat_chunks`` and ``response_events``
  are the server-sent events of a completion, carrying the same text, tool calls and
  (when asked) the sampled tokens' log-probs. The policy samples a whole turn in the
  continuous batch before any byte is sent, so the events come at once, when the turn is
  sampled; what is streamed is what the trajectory holds.

What a Responses request may not use, refused with a 400 saying so: tools other than
functions, input other than text (images, files), reasoning or other items the endpoint
never returns, server-side state (``conversation``, stored ``prompt``s, ``background``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

LOGPROBS = "message.output_text.logprobs"
"""The ``include`` value asking for the sampled tokens' log-probs."""

_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSUPPORTED = {
    "conversation": "server-side conversations; send the history, or previous_response_id",
    "prompt": "stored prompts; send the instructions and input",
    "background": "background responses",
}


class RequestError(ValueError):
    """A request the endpoint cannot serve; its message says why (answered with 400)."""


# -- the Responses API: requests ------------------------------------------------------------


def check_responses_request(body: Any) -> None:
    """Raise ``RequestError`` for a Responses request the training endpoint cannot serve."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, what in _UNSUPPORTED.items():
        if body.get(key):
            raise RequestError(f"'{key}' is not supported by turnrl's training endpoint ({what})")
    items = body.get("input")
    if not (isinstance(items, str) or (isinstance(items, list) and items)):
        raise RequestError("'input' must be a string or a non-empty list of items")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise RequestError("'previous_response_id' must be a string")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise RequestError("'instructions' must be a string")
    for i, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise RequestError(
                f"tools[{i}] is a {kind!r} tool; the training endpoint serves function tools "
                "only (the agent runs its tools, the policy only calls them)"
            )
        if not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{i}] needs a string 'name'")
    if isinstance(items, list):
        for i, item in enumerate(items):
            _check_item(item, f"input[{i}]")


def _check_item(item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        if not isinstance(item.get("role"), str):
            raise RequestError(f"{where} is a message without a string 'role'")
        _text(item.get("content"), where)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise RequestError(f"{where} is a function_call without a string '{key}'")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise RequestError(f"{where} is a function_call_output without a string 'call_id'")
        _text(item.get("output"), where)
    else:
        raise RequestError(
            f"{where} is a {kind!r} item; the training endpoint takes messages, "
            "function_call and function_call_output items (what it returns, and the "
            "agent's tool results)"
        )


def conversation(
    body: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation a checked Responses request continues, as chat messages: the
    ``earlier`` messages (those of its ``previous_response_id``, its output last), then its
    ``input`` items. ``instructions`` are not part of it: as in OpenAI's API, they are
    each request's own and are not carried over by ``previous_response_id``."""
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages = [dict(m) for m in earlier]
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item.get("content"), "")})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: text and calls
                last["tool_calls"] = [*(last.get("tool_calls") or ()), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = _text(item.get("output"), "")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    return messages


def chat_request(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The chat-completions request a Responses request stands for, given its
    ``conversation``: the instructions first (a system message), function tools in the
    chat form, log-probs when ``include`` asks for them."""
    head = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    tools = []
    for tool in body.get("tools") or ():
        function = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
    chat: dict[str, Any] = {"messages": [*head, *messages]}
    if tools:
        chat["tools"] = tools
    if LOGPROBS in (body.get("include") or ()) or body.get("top_logprobs"):
        chat["logprobs"] = True
    return chat


def _text(content: Any, where: str) -> str:
    """A message's content as text (a string, or a list of text parts); anything else is a
    ``RequestError`` at ``where`` (empty ``where``: the content was checked already)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
                parts.append(str(part.get("text", "")))
            elif where:
                kind = part.get("type") if isinstance(part, dict) else part
                raise RequestError(
                    f"{where} holds a {kind!r} content part; the training endpoint takes text"
                )
        return "".join(parts)
    if where:
        raise RequestError(f"{where}'s content must be a string or a list of text parts")
    return str(content)


# -- the Responses API: responses -----------------------------------------------------------


def response_id(completion: Mapping[str, Any]) -> str:
    """The response's id, derived from the chat completion's (unique within the endpoint)."""
    return "resp_" + str(completion["id"]).removeprefix("chatcmpl-")


def response_object(completion: Mapping[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses-API response for the chat ``completion`` that answered ``body``."""
    rid = response_id(completion)
    choice = completion["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content") or not message.get("tool_calls"):
        text: dict[str, Any] = {
            "type": "output_text",
            "text": message.get("content") or "",
            "annotations": [],
        }
        if choice.get("logprobs"):
            text["logprobs"] = list(choice["logprobs"]["content"])
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid[5:]}",
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        )
    for call in message.get("tool_calls") or ():
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{call['id']}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    usage = completion.get("usage") or {}
    return {
        "id": rid,
        "object": "response",
        "created_at": float(completion.get("created", time.time())),
        "status": "completed",
        "model": completion.get("model"),
        "output": output,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "tools": list(body.get("tools") or ()),
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": False,
        "error": None,
        "incomplete_details": None,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def response_events(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The server-sent events of ``response``, in OpenAI's order: created, in progress,
    each output item added, filled (one text or arguments delta) and done, completed."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    start = {**response, "status": "in_progress", "output": [], "usage": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})  # fmt: skip
            for c, part in enumerate(item["content"]):
                logprobs = list(part.get("logprobs") or ())
                emit("response.content_part.added", **at, content_index=c,
                     part={**part, "text": "", "logprobs": []})  # fmt: skip
                emit("response.output_text.delta", **at, content_index=c, delta=part["text"],
                     logprobs=logprobs)  # fmt: skip
                emit("response.output_text.done", **at, content_index=c, text=part["text"],
                     logprobs=logprobs)  # fmt: skip
                emit("response.content_part.done", **at, content_index=c, part=part)
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})  # fmt: skip
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"],
                 arguments=item["arguments"])  # fmt: skip
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed", response=dict(response))
    return events


# -- chat completions: streaming ------------------------------------------------------------


def chat_chunks(completion: Mapping[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` events of ``completion``: the role, the content (with
    its log-probs) or each tool call whole, the finish reason, then the usage when
    ``stream_options.include_usage`` asked for it."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}],
        }
        if include_usage:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}, logprobs=choice.get("logprobs")))
    for i, call in enumerate(message.get("tool_calls") or ()):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append(
            {**head, "object": "chat.completion.chunk", "choices": [],
             "usage": completion.get("usage")}
        )  # fmt: skip
    return chunks


def server_sent_events(events: Sequence[Mapping[str, Any]], *, named: bool, done: bool) -> bytes:
    """``events`` as a ``text/event-stream`` body: each ``data: <json>`` (after ``event:
    <type>`` when ``named``, as the Responses API sends them), ``data: [DONE]`` last when
    ``done`` (as chat completions end)."""
    out = []
    for event in events:
        head = f"event: {event['type']}\n" if named else ""
        out.append(f"{head}data: {json.dumps(event)}\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()
