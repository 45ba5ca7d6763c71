"""Grammar text as P1 hands it to xgrammar (``engine/execution/structured.py`` compiles it).

Invariants:
- :func:`utf8_only` changes only character classes (and the lax JSON string character);
  quoted literals are copied untouched, so the language differs from xgrammar's own only by
  the characters its 0.2.9 release lets through by mistake (below).
- :func:`choice_source` is one literal per option, exactly the option's text.
"""

from __future__ import annotations

import json

import xgrammar as xgr

# xgrammar 0.2.9 (1) lets a length-bounded JSON string hold raw control characters (invalid
# JSON: json.loads refuses them; its unbounded strings exclude them) and (2) lets negated
# classes, and "." in a regex, match UTF-16 surrogates (ED A0..BF xx: not UTF-8, decoded as
# three U+FFFD, which broke maxLength). :func:`utf8_only` rewrites a grammar without both.
_LAX_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"
_SURROGATES = r"\uD800-\uDFFF"
_ANY_CHAR = r"\0-\U0010ffff"
_ANY_SCALAR = r"\0-\uD7FF\uE000-\U0010ffff"


def utf8_only(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` with JSON strings free of control characters and every character class
    free of surrogates (see above); quoted literals are copied untouched."""
    text = str(grammar).replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR)
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] not in '"[':
            out.append(text[i])
            i += 1
            continue
        close = '"' if text[i] == '"' else "]"
        j = i + 1
        while j < n and text[j] != close:
            j += 2 if text[j] == "\\" else 1
        body = text[i + 1 : j]
        if close == "]" and body.startswith("^"):
            body += _SURROGATES
        elif close == "]":
            body = body.replace(_ANY_CHAR, _ANY_SCALAR)
        out.append(text[i] + body + close)
        i = j + 1
    return xgr.Grammar.from_ebnf("".join(out))


def choice_source(spec: str) -> str:
    """The EBNF of a ``choice`` constraint: one literal per option."""
    options = json.loads(spec)
    if (
        not isinstance(options, list)
        or not options
        or not all(isinstance(o, str) and o for o in options)
    ):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(o) for o in options)
