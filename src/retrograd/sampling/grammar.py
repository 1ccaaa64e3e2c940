"""Byte grammars for constrained decoding, and the JSON-schema subset compiled into them.

A `Grammar` is a context-free grammar over bytes in the shape llama.cpp's GBNF engine runs:
rules of alternatives, an alternative a sequence of byte classes and rule references. A parse
state is a frozenset of stacks; a stack is a tuple of (alternative, position) pairs, top last,
each naming the next element to match, and the top always a byte class once expanded. Feeding
a byte keeps the stacks whose top class holds it, steps past it and expands rule references
into each of their alternatives (left recursion is refused when a schema is compiled, so
expansion ends). The empty stack means the whole input matched: `accepts`. `done` means
nothing more may follow. Steps are memoized by (state, byte), so a loop (the characters of a
string) costs one dictionary lookup per byte.

`json_schema_grammar(schema)` compiles the subset of JSON Schema that structured-output APIs
use (as llama.cpp's json-schema-to-grammar does): type (one or a list), properties, required
and additionalProperties (properties in their listed order, the required ones always present,
as llama.cpp orders them), items and prefixItems, minItems/maxItems, enum, const, anyOf/oneOf, $ref into
$defs/definitions, minLength/maxLength (counted in bytes: never more characters than
maxLength allows, though a string of non-ASCII characters may fall short of minLength), a minimum of 0 (no minus sign) and a number range
within single digits (a score in [0, 1]). Annotations (title, description, format, default,
examples, ...) are ignored; keywords that would constrain what the grammar cannot say
(pattern, not, ...) are refused with SchemaError naming their place. Whitespace between tokens
is bounded (llama.cpp's: nothing, one space, or one or two newlines and up to 20 spaces or
tabs), and so are digits, so a model cannot fill its budget with them. Strings take any bytes
but quotes, backslashes and control characters, plus JSON escapes; bytes of multi-byte
characters are not checked as UTF-8 (a stray byte decodes to U+FFFD, still a JSON string).
A schema is a client's: left recursion, more than MAX_RULES rules, or a start of more than
MAX_STACKS parse stacks is a SchemaError, and expansion is iterative and deduplicated (a chain
of two-way choices to one place costs its distinct stacks, not 2^n paths). Knows nothing about
tokens or tensors.
"""

from __future__ import annotations

import json
from typing import Any

Stack = tuple[tuple[int, int], ...]
State = frozenset  # of Stack

MAX_WS_INDENT = 20  # spaces or tabs after a newline
MAX_INT_DIGITS = 16  # after the leading one, as llama.cpp's integral-part
MAX_FRACTION_DIGITS = 16
MEMO_LIMIT = 1 << 20  # memoized steps kept before the memo is cleared
MAX_RULES = 1 << 17  # a compiled schema's rules: a client's schema must not take gigabytes
MAX_STACKS = 1 << 15  # parse stacks one state may hold: a schema ambiguous past it is refused

IGNORED = frozenset(
    {
        "$schema", "$id", "$comment", "title", "description", "default", "examples",
        "format", "readOnly", "writeOnly", "deprecated", "strict", "name",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "$defs", "definitions", "minProperties", "maxProperties", "uniqueItems",
    }
)  # fmt: skip
STRUCTURAL = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
        "minLength", "maxLength",
    }
)  # fmt: skip


class SchemaError(ValueError):
    """A schema this compiler cannot turn into a grammar; the message names the place."""


class GrammarTooLarge(ValueError):
    """A grammar past MAX_RULES rules, or a state past MAX_STACKS stacks."""


def byte_class(*spans: tuple[int, int] | int) -> frozenset[int]:
    out: set[int] = set()
    for s in spans:
        lo, hi = (s, s) if isinstance(s, int) else s
        out.update(range(lo, hi + 1))
    return frozenset(out)


# bytes a string holds unescaped: not a quote, a backslash, a control character or DEL (as
# llama.cpp's grammar, which also leaves out the escape \/)
STRING_BYTE = byte_class((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x7E), (0x80, 0xFF))
DIGIT = byte_class((0x30, 0x39))


class Grammar:
    """Rules of alternatives over bytes; `start` is the initial state."""

    def __init__(self, max_rules: int | None = None) -> None:
        self.max_rules = max_rules
        self._start: State | None = None
        self.alts: list[tuple] = []  # each: a tuple of elements (frozenset bytes or int rule)
        self.rules: list[list[int]] = []  # rule -> its alternatives' indices
        self._memo: dict[tuple[State, int], State] = {}
        self._next: dict[State, frozenset[int]] = {}
        self._loops: dict[State, bool] = {}
        self.token_cache: dict = {}  # what a vocabulary's side keeps per state (constrain.py)
        self.root: int | None = None

    # -- building ------------------------------------------------------------------------------

    def rule(self) -> int:
        """A new rule without alternatives yet (so that rules can refer to each other)."""
        if self.max_rules is not None and len(self.rules) >= self.max_rules:
            raise GrammarTooLarge(f"more than {self.max_rules} grammar rules")
        self.rules.append([])
        return len(self.rules) - 1

    def add(self, rule: int, *elements) -> None:
        """One alternative of `rule`: bytes literals, byte classes and rule numbers."""
        seq: list = []
        for e in elements:
            if isinstance(e, bytes):
                seq.extend(frozenset((b,)) for b in e)
            else:
                seq.append(e)
        self.alts.append(tuple(seq))
        self.rules[rule].append(len(self.alts) - 1)

    def define(self, *alternatives) -> int:
        """A new rule with these alternatives (each a tuple of elements, or one element)."""
        r = self.rule()
        for alt in alternatives:
            self.add(r, *(alt if isinstance(alt, tuple) else (alt,)))
        return r

    # -- running -------------------------------------------------------------------------------

    @property
    def start(self) -> State:
        assert self.root is not None, "a grammar needs its root rule"
        if self._start is None:
            self._start = self._closure(
                [((a, 0),) if self.alts[a] else () for a in self.rules[self.root]]
            )
        return self._start

    def _closure(self, stacks) -> State:
        """The stacks expanded: rule references at the top replaced by each alternative of
        their rule until a byte class is there (or nothing is). Iterative and deduplicated, so
        a chain of rules with two ways to each next one costs its distinct stacks, not 2^n;
        GrammarTooLarge past MAX_STACKS of them (left recursion, refused when a schema is
        compiled, would otherwise grow stacks forever)."""
        out: set[Stack] = set()
        seen: set[Stack] = set()
        work = list(stacks)
        while work:
            stack = work.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if len(seen) > MAX_STACKS:
                raise GrammarTooLarge(f"a parse state of more than {MAX_STACKS} stacks")
            if not stack:
                out.add(stack)
                continue
            a, p = stack[-1]
            element = self.alts[a][p]
            if isinstance(element, frozenset):
                out.add(stack)
                continue
            rest = stack[:-1] + (((a, p + 1),) if p + 1 < len(self.alts[a]) else ())
            work.extend(rest + ((b, 0),) if self.alts[b] else rest for b in self.rules[element])
        return frozenset(out)

    def step(self, state: State, byte: int) -> State:
        """The state after one byte; empty when the byte is not allowed."""
        key = (state, byte)
        out = self._memo.get(key)
        if out is None:
            rests = []
            for stack in state:
                if not stack:
                    continue
                a, p = stack[-1]
                if byte in self.alts[a][p]:
                    rests.append(stack[:-1] + (((a, p + 1),) if p + 1 < len(self.alts[a]) else ()))
            out = self._closure(rests)
            if len(self._memo) >= MEMO_LIMIT:
                self._memo.clear()
            self._memo[key] = out
        return out

    def left_cycle(self) -> int | None:
        """A rule that can reach itself before any byte (left recursion: expanding it would
        never end), or None. Rules that can match nothing are followed through."""
        nullable: set[int] = set()
        changed = True
        while changed:  # the rules that can match the empty text
            changed = False
            for r, alts in enumerate(self.rules):
                if r not in nullable and any(
                    all(isinstance(e, int) and e in nullable for e in self.alts[a]) for a in alts
                ):
                    nullable.add(r)
                    changed = True
        first: list[set[int]] = [set() for _ in self.rules]  # rules reached before a byte
        for r, alts in enumerate(self.rules):
            for a in alts:
                for e in self.alts[a]:
                    if not isinstance(e, int):
                        break
                    first[r].add(e)
                    if e not in nullable:
                        break
        color = [0] * len(self.rules)  # 0 new, 1 on the path, 2 done
        for root in range(len(self.rules)):
            if color[root]:
                continue
            path = [(root, iter(first[root]))]
            color[root] = 1
            while path:
                r, edges = path[-1]
                nxt = next(edges, None)
                if nxt is None:
                    color[r] = 2
                    path.pop()
                elif color[nxt] == 1:
                    return nxt
                elif color[nxt] == 0:
                    color[nxt] = 1
                    path.append((nxt, iter(first[nxt])))
        return None

    def feed(self, state: State, data: bytes) -> State:
        for b in data:
            state = self.step(state, b)
            if not state:
                break
        return state

    def next_bytes(self, state: State) -> frozenset[int]:
        """The bytes that may come next."""
        out = self._next.get(state)
        if out is None:
            out = frozenset(b for s in state if s for b in self.alts[s[-1][0]][s[-1][1]])
            self._next[state] = out
        return out

    def plain_loop(self, state: State, plain: frozenset[int]) -> bool:
        """True when every byte of `plain` leaves the state as it is (inside a string)."""
        out = self._loops.get(state)
        if out is None:
            out = plain <= self.next_bytes(state) and all(
                self.step(state, b) == state for b in plain
            )
            self._loops[state] = out
        return out

    @staticmethod
    def accepts(state: State) -> bool:
        """The input so far is a whole sentence (it may end here)."""
        return () in state

    @staticmethod
    def done(state: State) -> bool:
        """A whole sentence that nothing may extend."""
        return state == frozenset({()})


# -- JSON ------------------------------------------------------------------------------------


def json_schema_grammar(schema: Any) -> Grammar:
    """A grammar for the JSON texts `schema` admits (see the module docstring); a schema of
    None (or {}) admits any object, as response_format json_object does."""
    if schema is None:
        schema = {"type": "object"}
    try:
        compiler = _JsonCompiler(schema)
    except GrammarTooLarge as e:
        raise SchemaError(
            f"schema: compiles to {e} (fewer properties, or lower maxLength, maxItems bounds)"
        ) from None
    g = compiler.g
    cycle = g.left_cycle()
    if cycle is not None:  # llama.cpp refuses it too: expanding it would never end
        refs = [ref for ref, rule in compiler._refs.items() if rule == cycle]
        named = f"{refs[0]} refers" if refs else "a part refers"
        raise SchemaError(f"schema: {named} to itself before any text (left recursion)")
    try:
        g.start  # noqa: B018 (computed once here, under its bound, not in a request's row)
    except GrammarTooLarge as e:
        raise SchemaError(f"schema: too ambiguous: {e} at its start") from None
    return g


class _JsonCompiler:
    def __init__(self, schema: Any) -> None:
        self.doc = schema
        self.g = Grammar(max_rules=MAX_RULES)
        g = self.g
        indent = g.define(())
        for _ in range(MAX_WS_INDENT):
            indent = g.define((), (byte_class(0x20, 0x09), indent))
        self.space = g.define((), b" ", (b"\n", indent), (b"\n\n", indent))
        hexd = byte_class((0x30, 0x39), (0x41, 0x46), (0x61, 0x66))
        escape = g.define(byte_class(*b'"\\bfnrt'), (b"u", hexd, hexd, hexd, hexd))
        self.char = g.define(STRING_BYTE, (b"\\", escape))
        chars = g.rule()
        g.add(chars)
        g.add(chars, self.char, chars)
        self.string = g.define((b'"', chars, b'"'))
        self._digits: dict[tuple[int, int], int] = {}
        self._refs: dict[str, int] = {}
        self._any: int | None = None
        g.root = self.value(schema, "schema")

    # -- pieces --------------------------------------------------------------------------------

    def repeat(self, element, lo: int, hi: int | None) -> int:
        """`element` lo to hi times (hi None: no limit)."""
        g = self.g
        if hi is None:
            tail = g.rule()
            g.add(tail)
            g.add(tail, element, tail)
        else:
            tail = g.define(())
            for _ in range(hi - lo):
                tail = g.define((), (element, tail))
        return g.define((*([element] * lo), tail))

    def digits(self, lo: int, hi: int) -> int:
        key = (lo, hi)
        if key not in self._digits:
            self._digits[key] = self.repeat(DIGIT, lo, hi)
        return self._digits[key]

    def number(self, integer: bool, schema: dict, where: str) -> int:
        g = self.g
        low, high = schema.get("minimum"), schema.get("maximum")
        sign = () if isinstance(low, (int, float)) and low >= 0 else (g.define((), b"-"),)
        if (
            not integer
            and isinstance(low, (int, float))
            and isinstance(high, (int, float))
            and 0 <= low <= high <= 9
            and float(low).is_integer()
            and float(high).is_integer()
        ):
            # a range within single digits: d.ddd with d below the maximum, the maximum with
            # zeros only (0 to 1: "0", "0.73", "1", "1.0")
            lo, hi = int(low), int(high)
            alts = []
            if hi > lo:
                alts.append((byte_class((0x30 + lo, 0x30 + hi - 1)), self._fraction()))
            zeros = self.repeat(frozenset(b"0"), 1, MAX_FRACTION_DIGITS)
            alts.append((bytes([0x30 + hi]), g.define((), (b".", zeros))))
            return g.define(*alts)
        integral = g.define(b"0", (byte_class((0x31, 0x39)), self.digits(0, MAX_INT_DIGITS)))
        if integer:
            return g.define((*sign, integral))
        exponent = g.define((), (byte_class(*b"eE"), g.define((), byte_class(*b"+-")), integral))
        return g.define((*sign, integral, self._fraction(), exponent))

    def _fraction(self) -> int:
        return self.g.define((), (b".", self.digits(1, MAX_FRACTION_DIGITS)))

    def literal(self, value: Any) -> bytes:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": ")).encode()

    def any_value(self) -> int:
        """Any JSON value."""
        if self._any is None:
            g = self.g
            self._any = g.rule()
            for alt in (
                self.object({}, "any"),
                self.array({}, "any"),
                self.string,
                self.number(False, {}, "any"),
                b"true",
                b"false",
                b"null",
            ):
                g.add(self._any, alt)
        return self._any

    # -- schemas -------------------------------------------------------------------------------

    def value(self, schema: Any, where: str) -> int:
        g = self.g
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: expected a schema object, got {json.dumps(schema)}")
        for key in schema:
            if key not in IGNORED and key not in STRUCTURAL:
                raise SchemaError(
                    f"{where}.{key}: not supported for constrained decoding (supported: "
                    + ", ".join(sorted(STRUCTURAL))
                    + ")"
                )
        if "$ref" in schema:
            return self.ref(schema["$ref"], where)
        if "const" in schema:
            return g.define(self.literal(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{where}.enum: expected a non-empty list")
            return g.define(*(self.literal(v) for v in values))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{where}.{key}: expected a non-empty list of schemas")
                return g.define(
                    *(self.value(s, f"{where}.{key}[{i}]") for i, s in enumerate(options))
                )
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise SchemaError(f"{where}.allOf: only a single schema is supported")
            return self.value(parts[0], f"{where}.allOf[0]")
        kind = schema.get("type")
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                return self.any_value()
        if isinstance(kind, list):
            if not kind:
                raise SchemaError(f"{where}.type: expected at least one type")
            return g.define(*(self.typed(k, schema, where) for k in kind))
        return self.typed(kind, schema, where)

    def typed(self, kind: Any, schema: dict, where: str) -> int:
        g = self.g
        if kind == "object":
            return self.object(schema, where)
        if kind == "array":
            return self.array(schema, where)
        if kind == "string":
            lo, hi = _bounds(schema, "minLength", "maxLength", where)
            if lo == 0 and hi is None:
                return self.string
            return g.define((b'"', self.repeat(self.char, lo, hi), b'"'))
        if kind in ("number", "integer"):
            return self.number(kind == "integer", schema, where)
        if kind == "boolean":
            return g.define(b"true", b"false")
        if kind == "null":
            return g.define(b"null")
        raise SchemaError(f"{where}.type: unknown type {json.dumps(kind)}")

    def object(self, schema: dict, where: str) -> int:
        g, sp = self.g, self.space
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{where}.properties: expected an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            missing = [r for r in required if r not in props] if isinstance(required, list) else []
            raise SchemaError(
                f"{where}.required: expected names of properties"
                + (f" ({', '.join(map(str, missing))} not among them)" if missing else "")
            )
        extra = schema.get("additionalProperties", not props)
        items = []  # (key-value rule, required), required ones first, each in listed order
        for name in [p for p in props if p in required] + [p for p in props if p not in required]:
            value = self.value(props[name], f"{where}.properties.{name}")
            kv = g.define((self.literal(name), sp, b":", sp, value, sp))
            items.append((kv, name in required))
        if extra is not False:
            value = (
                self.any_value()
                if extra is True
                else self.value(extra, f"{where}.additionalProperties")
            )
            kv = g.define((self.string, sp, b":", sp, value, sp))
            more = g.rule()
            g.add(more)
            g.add(more, b",", sp, kv, more)
            items.append((g.define((kv, more)), False))
        comma = g.define((b",", sp))
        # body[i][first]: items i.. with `first` true when nothing was written yet
        body: dict[tuple[int, bool], int] = {}
        for i in range(len(items), -1, -1):
            for first in (True, False):
                if i == len(items):
                    body[i, first] = g.define(())
                    continue
                kv, req = items[i]
                lead = (kv,) if first else (comma, kv)
                alts = [(*lead, body[i + 1, False])]
                if not req:
                    alts.append(body[i + 1, first])
                body[i, first] = g.define(*alts)
        return g.define((b"{", sp, body[0, True], b"}"))

    def array(self, schema: dict, where: str) -> int:
        g, sp = self.g, self.space
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaError(f"{where}.prefixItems: expected a list of schemas")
        items = schema.get("items", True)
        lo, hi = _bounds(schema, "minItems", "maxItems", where)
        if hi is not None:
            prefix = prefix[:hi]
        # after the prefix: `items` (none when false), up to what maxItems leaves
        rest = None
        room = None if hi is None else hi - len(prefix)
        if items is not False and room != 0:
            item = g.define((self.value(items, f"{where}.items"), sp))
            more = g.define((b",", sp, item))
            need = max(0, lo - len(prefix))
            if prefix:
                rest = self.repeat(more, need, room)
            else:
                rest = g.define(
                    (item, self.repeat(more, max(0, need - 1), None if room is None else room - 1))
                )
                if need == 0:
                    rest = g.define((), rest)
        elif lo > len(prefix):
            raise SchemaError(f"{where}.minItems = {lo}: more than its items allow")
        # the prefix, each element after the first behind a comma; those past minItems optional
        tail = rest if rest is not None else g.define(())
        for i in range(len(prefix) - 1, -1, -1):
            element = g.define((self.value(prefix[i], f"{where}.prefixItems[{i}]"), sp))
            seq = (element, tail) if i == 0 else (b",", sp, element, tail)
            tail = g.define(seq) if i < lo else g.define((), seq)
        return g.define((b"[", sp, tail, b"]"))

    def ref(self, ref: Any, where: str) -> int:
        if ref in self._refs:
            return self._refs[ref]
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise SchemaError(
                f"{where}.$ref: only #/$defs/NAME and #/definitions/NAME are supported"
            )
        target = (
            (self.doc.get(parts[1]) or {}).get(parts[2]) if isinstance(self.doc, dict) else None
        )
        if target is None:
            raise SchemaError(f"{where}.$ref: {ref} is not defined")
        g = self.g
        r = self._refs[ref] = g.rule()  # before compiling: the target may refer to itself
        g.add(r, self.value(target, ref))
        return r


def _bounds(schema: dict, low: str, high: str, where: str) -> tuple[int, int | None]:
    lo, hi = schema.get(low, 0), schema.get(high)
    for key, v in ((low, lo), (high, hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise SchemaError(f"{where}.{key}: expected a non-negative integer")
    if hi is not None and hi < lo:
        raise SchemaError(f"{where}.{high} = {hi}: below {low} = {lo}")
    if max(lo, hi or 0) > 4096:
        raise SchemaError(f"{where}: bounds above 4096 are not supported")
    return lo, hi
