"""Tool calls out of generated text, whole and streamed (one :class:`ToolCallParser` per choice).

Three modes, after the request's ``tool_choice`` (:func:`parser_for`):

- ``auto``: the Hermes / Qwen2.5 format, ``<tool_call>\\n{"name": N, "arguments": {...}}
  \\n</tool_call>`` (any number of them). The text before the first call is the content; text
  after it outside the calls is dropped (as vLLM's Hermes parser does). A whole answer whose
  calls are not all well-formed JSON objects with a string name is plain content, no calls.
- ``named`` (``{"type": "function", ...}``): the output *is* the arguments (the structured
  output constrains it to the function's parameters schema); ``finish_reason`` stays.
- ``required``: the output is a JSON array of ``{"name": N, "parameters": {...}}`` (the
  structured output constrains it to one of the tools each).

Invariants:
- ``arguments`` is the model's own text of the arguments value (a JSON string, as OpenAI
  returns it), in whole answers and streams alike: a stream's fragments of a call concatenate
  to exactly the whole answer's ``arguments``, split wherever the tokens fall.
- Streams never leak markup into content: a suffix that may begin ``<tool_call>`` is held
  back until it cannot, and released at the end.
- A call's first delta carries ``index``, ``id`` (``call_<24 hex>``), ``type`` and
  ``function.name`` (``arguments: ""``); then only argument fragments follow. An open
  arguments value is streamed only while it is a valid JSON prefix (``partial-json-parser``);
  positions come from the standard library's decoder (``raw_decode`` / ``scanstring``).
- ``finish_reason`` ``stop`` becomes ``tool_calls`` when calls were made (``auto``,
  ``required``) and the answer parses into calls (a stream whose call turned out malformed
  ends ``stop``); ``length`` stays ``length`` (the client learns the call may be cut).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from json.decoder import JSONDecodeError

from partial_json_parser import loads as partial_loads

from mmis.frontend.api.schemas.tools import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
scanstring = json.decoder.scanstring  # type: ignore[attr-defined]  # (C) str and its end


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\n\r":
        i += 1
    return i


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class Scan:
    """How far a JSON object's text is complete: its complete top-level values by key (raw
    spans), the key whose value is still being written, and where the object ends."""

    values: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    open_key: str | None = None
    open_start: int = 0
    end: int | None = None
    malformed: bool = False


def _valid_prefix(text: str) -> bool:
    try:
        partial_loads(text)
    except Exception:  # MalformedJSON, and the library's IndexErrors on some junk
        return False
    return True


def scan_object(s: str, i: int) -> Scan:
    """Scan the JSON object starting at ``s[i]`` (after whitespace) as far as it is written."""
    scan = Scan()
    i = _skip_ws(s, i)
    if i == len(s):
        return scan
    if s[i] != "{":
        scan.malformed = True
        return scan
    i += 1
    first = True
    while True:
        i = _skip_ws(s, i)
        if i == len(s):
            return scan
        if s[i] == "}":
            scan.end = i + 1
            return scan
        if not first:
            if s[i] != ",":
                scan.malformed = True
                return scan
            i = _skip_ws(s, i + 1)
            if i == len(s):
                return scan
        if s[i] != '"':
            scan.malformed = True
            return scan
        try:
            key, i = scanstring(s, i + 1)
        except JSONDecodeError as exc:
            scan.malformed = not exc.msg.startswith("Unterminated")
            return scan
        i = _skip_ws(s, i)
        if i == len(s):
            return scan
        if s[i] != ":":
            scan.malformed = True
            return scan
        i = _skip_ws(s, i + 1)
        scan.open_key, scan.open_start = key, i
        if i == len(s):
            return scan
        try:
            _, end = _DECODER.raw_decode(s, i)
        except JSONDecodeError:
            scan.malformed = not _valid_prefix(s[i:])
            return scan
        if end == len(s) and s[i] not in '{["tfn':  # a number may still grow
            return scan
        scan.values[key] = (i, end)
        scan.open_key = None
        i, first = end, False


@dataclasses.dataclass
class _Call:
    start: int  # where the call's JSON object starts in the text
    index: int
    id: str = dataclasses.field(default_factory=new_call_id)
    name: str | None = None
    arguments: str = ""  # sent so far
    end: int | None = None  # past the object, once closed
    valid: bool = True


@dataclasses.dataclass
class Delta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Parsed:
    content: str | None
    tool_calls: list[ToolCall]


class ToolCallParser:
    """One choice's parser; :meth:`feed` the text deltas, then read :meth:`result`."""

    def __init__(self, parallel: bool = True) -> None:
        self.text = ""
        self.parallel = parallel
        self.calls: list[_Call] = []
        self.content = ""

    def feed(self, delta: str, final: bool = False) -> Delta:
        raise NotImplementedError

    def finish(self, reason: str | None) -> str | None:
        """The choice's finish reason once all text was fed (see the module docstring)."""
        return "tool_calls" if reason == "stop" and self.result().tool_calls else reason

    def result(self) -> Parsed:
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in self.calls
            if c.name is not None
        ]
        return Parsed(self.content or None, calls)

    def _advance(self, call: _Call, scan: Scan, args_key: str, out: Delta) -> None:
        """Emit what ``scan`` newly shows of ``call``: its header once the name is complete,
        then the arguments' raw text."""
        if scan.malformed:
            call.valid = False
            return
        if call.name is None:
            span = scan.values.get("name")
            if span is None:
                return
            name = json.loads(self.text[span[0] : span[1]])
            if not isinstance(name, str) or not name:
                call.valid = False
                return
            call.name = name
            out.tool_calls.append(
                ToolCallDelta(
                    index=call.index,
                    id=call.id,
                    type="function",
                    function=FunctionCallDelta(name=name, arguments=""),
                )
            )
        span = scan.values.get(args_key)
        if span is None and scan.open_key == args_key:
            span = (scan.open_start, len(self.text))
        if span is not None:
            raw = self.text[span[0] : span[1]]
            piece = raw[len(call.arguments) :]
        elif scan.end is not None and not call.arguments:
            piece = "{}"  # a call without arguments
        else:
            piece = ""
        if piece:
            call.arguments += piece
            out.tool_calls.append(
                ToolCallDelta(index=call.index, function=FunctionCallDelta(arguments=piece))
            )
        if scan.end is not None:
            call.end = scan.end
            if span is not None:  # the arguments must be an object
                value = self.text[span[0] : span[1]]
                call.valid = call.valid and value.lstrip().startswith("{")


def _held_back(text: str, start: int, marker: str) -> int:
    """How many trailing characters of ``text[start:]`` may begin ``marker``."""
    for keep in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - keep :]):
            return keep
    return 0


class HermesParser(ToolCallParser):
    """``auto``: ``<tool_call>`` JSON blocks (see the module docstring)."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.pos = 0  # consumed up to here
        self.current: _Call | None = None
        self.failed = False  # a block that is not a well-formed call
        self.done = False  # no more calls (parallel_tool_calls false)

    def feed(self, delta: str, final: bool = False) -> Delta:
        self.text += delta
        out = Delta()
        while not self.done:
            if self.current is None and not self._outside(out, final):
                break
            if self.current is not None and not self._inside(self.current, out, final):
                break
        if final and self.current is not None:  # cut inside a call
            self.failed = True
        self.content += out.content
        return out

    def _outside(self, out: Delta, final: bool) -> bool:
        k = self.text.find(CALL_START, self.pos)
        if k < 0:
            upto = len(self.text) - (0 if final else _held_back(self.text, self.pos, CALL_START))
            if not self.calls and not self.failed:
                out.content += self.text[self.pos : upto]
            self.pos = upto
            return False
        if not self.calls and not self.failed:
            out.content += self.text[self.pos : k]
        if self.calls and not self.parallel:
            self.done = True
            return False
        self.pos = k + len(CALL_START)
        self.current = _Call(start=self.pos, index=len(self.calls))
        self.calls.append(self.current)
        return True

    def _inside(self, call: _Call, out: Delta, final: bool) -> bool:
        if call.valid:
            self._advance(call, scan_object(self.text, call.start), "arguments", out)
        if call.valid and call.end is None:
            return False  # the object is still being written
        after = call.end if call.valid and call.end is not None else call.start
        close = self.text.find(CALL_END, after)
        if close >= 0:
            self.pos = close + len(CALL_END)
        elif call.valid and (final or not CALL_END.startswith(self.text[after:].lstrip())):
            self.pos = after  # a closed object without its end tag: accept it
        else:
            return False  # waiting for the end tag
        if not call.valid:
            self.failed = True
        self.current = None
        return True

    def result(self) -> Parsed:
        if self.failed or any(not c.valid or c.name is None for c in self.calls):
            return Parsed(self.text or None, [])  # not well-formed: it is all content
        return super().result()


class NamedParser(ToolCallParser):
    """``tool_choice`` naming a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.calls.append(_Call(start=0, index=0, name=name))

    def feed(self, delta: str, final: bool = False) -> Delta:
        self.text += delta
        call = self.calls[0]
        out = Delta()
        if not delta:
            return out
        if not call.arguments:
            out.tool_calls.append(
                ToolCallDelta(
                    index=0,
                    id=call.id,
                    type="function",
                    function=FunctionCallDelta(name=call.name, arguments=""),
                )
            )
        call.arguments += delta
        out.tool_calls.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=delta)))
        return out

    def finish(self, reason: str | None) -> str | None:
        return reason  # OpenAI and vLLM answer a forced function with its own reason

    def result(self) -> Parsed:
        call = self.calls[0]
        function = FunctionCall(name=call.name or "", arguments=self.text)
        return Parsed(None, [ToolCall(id=call.id, function=function)])


class RequiredParser(ToolCallParser):
    """``required``: a JSON array of ``{"name", "parameters"}`` objects."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0  # where the next element (or the array's start) is read
        self.opened = False
        self.closed = False
        self.bad = False

    def feed(self, delta: str, final: bool = False) -> Delta:
        self.text += delta
        out = Delta()
        while not (self.closed or self.bad) and self._step(out):
            pass
        return out

    def _step(self, out: Delta) -> bool:
        s = self.text
        i = _skip_ws(s, self.pos)
        if i == len(s):
            return False
        if not self.opened:
            if s[i] != "[":
                self.bad = True
                return False
            self.opened, self.pos = True, i + 1
            return True
        call = self.calls[-1] if self.calls and self.calls[-1].end is None else None
        if call is None:
            if s[i] == "]":
                self.closed = True
                return False
            if self.calls:
                if s[i] != ",":
                    self.bad = True
                    return False
                i = _skip_ws(s, i + 1)
                if i == len(s):
                    return False
            call = _Call(start=i, index=len(self.calls))
            self.calls.append(call)
        self._advance(call, scan_object(s, call.start), "parameters", out)
        if not call.valid:
            self.bad = True
            return False
        if call.end is None:
            return False
        self.pos = call.end
        return True

    def result(self) -> Parsed:
        if self.bad or not self.closed or any(c.name is None for c in self.calls):
            return Parsed(self.text or None, [])
        return super().result()


def parser_for(choice: str | None, name: str | None, parallel: bool) -> ToolCallParser | None:
    """The parser for a request's effective ``tool_choice`` (``None``: no parsing)."""
    if choice == "auto":
        return HermesParser(parallel)
    if choice == "required":
        return RequiredParser()
    if choice == "named" and name is not None:
        return NamedParser(name)
    return None
