"""The OpenAI request bodies the API validates (pydantic, strict types), and its error body: HTTP 4xx with
``{"error": {"message", "type", "param": <field>, "code"}}``, ``param`` naming the offending field."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

# Accepted for compatibility only at their neutral value.
UNSUPPORTED = ("best_of", "suffix", "logit_bias", "functions", "presence_penalty", "frequency_penalty")


class _Strict(BaseModel):
    # strict: "5" is not an int and 1.5 not an int; unknown fields are ignored, as OpenAI does
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    reasoning_content: str | None = None  # assistant
    tool_call_id: str | None = None  # tool


class Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # "none": the tools are not offered; "required" / a named function: the turn must call one
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None


class TokenizeRequest(_Strict):
    prompt: str


class DetokenizeRequest(_Strict):
    tokens: list[int]


class ProfileRequest(_Strict):
    num_steps: int = 10  # the engine steps to trace (SGLang's field)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers=headers)


def param_path(loc: tuple) -> str:
    """A pydantic error location as a field path: ("messages", 0, "content", ...) -> messages[0].content."""
    out = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (out.startswith("messages") and part in Message.model_fields) or (
                out.startswith("tools") and part in Tool.model_fields):
            out += f".{part}"
        else:
            break  # a union member's name (e.g. "list[int]"), not a field
    return out
