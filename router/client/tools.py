"""Plain Python functions as ``python`` tools: `sandboxed_tool`.

The sandbox runs the function's own source and nothing else from its module: the source is
taken from the function's file with `ast` (whatever its decorators and layout), without its
decorators and parameter annotations (they describe the arguments for the JSON Schema; in the
sandbox they would be evaluated with nothing imported). A function that could not run there is
refused when it is decorated, not on every call: one that uses a name from outside it (a module
level helper, constant or import, a variable of an enclosing function), an async function or
generator, a lambda, a function whose source is not in a file, a method, or a parameter typed
with something the sandbox cannot pass. The sandbox passes each argument as its JSON value (no
pydantic there to convert it), so a parameter's type hint must be one whose JSON value is the
Python value: ``str``, ``int``, ``float``, ``bool``, ``None``, ``list[...]`` (or ``Sequence``,
``Collection``, ``Iterable``), ``dict[str, ...]`` (or ``Mapping[str, ...]``), ``Literal[...]``, a
``TypedDict`` of those, a ``NewType`` of one, ``Optional``/unions of them, ``Any`` or ``object`` (a model, an
``Enum``, a ``datetime``, a ``tuple`` or a ``set`` would arrive as a dict, str or list). The
schema forbids arguments the function has no parameter for.
"""

from __future__ import annotations

import ast
import builtins
import collections.abc
import functools
import inspect
import linecache
import symtable
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Generic, Literal, ParamSpec, TypeVar, Union, overload

from pydantic import TypeAdapter, ValidationError, create_model
from typing_extensions import is_typeddict

from router.errors import InvalidToolSpec
from router.wire import ToolSpec

P = ParamSpec("P")
R = TypeVar("R")

# The sandbox runs Python without `site`, so the names it adds to builtins are not there.
_BUILTINS = frozenset(dir(builtins)) - {"exit", "quit", "help", "copyright", "credits", "license"}
# Hints whose JSON value is the Python value (`_json_hint`).
_JSON_SCALARS: tuple[object, ...] = (str, int, float, bool, type(None), None, Any, object)
# Read-only collection types a JSON array (a list) or object (a dict) already is.
_SEQUENCES: tuple[object, ...] = (list, collections.abc.Sequence, collections.abc.Collection, collections.abc.Iterable)
_MAPPINGS: tuple[object, ...] = (dict, collections.abc.Mapping)


class SandboxedTool(Mapping[str, Any], Generic[P, R]):
    """A function made a ``python`` tool by `sandboxed_tool`. Calling it calls the function (locally,
    for unit tests); as a mapping it is the tool's spec (``spec``, as JSON), so ``register`` takes
    it, in process or over HTTP."""

    def __init__(self, function: Callable[P, R], spec: ToolSpec) -> None:
        self.function = function
        self.spec = spec
        self._document = spec.model_dump(mode="json")
        functools.update_wrapper(self, function)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.function(*args, **kwargs)

    def __getitem__(self, key: str) -> Any:
        return self._document[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._document)

    def __len__(self) -> int:
        return len(self._document)

    def __repr__(self) -> str:
        return f"<sandboxed tool {self.spec.name!r} ({self.function.__qualname__})>"


@overload
def sandboxed_tool(function: Callable[P, R], /) -> SandboxedTool[P, R]: ...


@overload
def sandboxed_tool(**spec: Any) -> Callable[[Callable[P, R]], SandboxedTool[P, R]]: ...


def sandboxed_tool(
    function: Callable[P, R] | None = None, /, **spec: Any
) -> SandboxedTool[P, R] | Callable[[Callable[P, R]], SandboxedTool[P, R]]:
    """Decorator: a plain Python function (self-contained: imports inside it) as a ``python`` tool,
    its JSON Schema taken from the type hints, its description from the docstring. ``spec``: any
    other `ToolSpec` field (``risk``, default ``low``; ``capabilities``, ``sandbox``, ``name`` ...).

        @sandboxed_tool(risk="low")
        def word_count(text: str) -> int:
            "Count the words in a text."
            return len(text.split())

        await client.register(word_count)

    Raises:
        InvalidToolSpec: at decoration, naming the function and what keeps it from running in the
            sandbox (a name from outside it, an async function ...), or a malformed ``spec``.
    """

    def wrap(function: Callable[P, R]) -> SandboxedTool[P, R]:
        source, name = _source(function)
        try:
            tool = ToolSpec.model_validate({
                "name": name, "description": inspect.getdoc(function) or name, "input_schema": _schema(function),
                "executor": {"kind": "python", "source": source, "entrypoint": name}, "risk": "low", **spec,
            })  # fmt: skip
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(spec)'}: {e['msg']}" for e in exc.errors()[:10])
            raise InvalidToolSpec(f"@sandboxed_tool {name}: invalid tool spec: {problems}") from exc
        return SandboxedTool(function, tool)

    return wrap if function is None else wrap(function)


def _source(function: Callable[..., Any]) -> tuple[str, str]:
    """The source the sandbox runs for ``function`` (the function alone, as a module), and its name.

    Raises:
        InvalidToolSpec: the function could not run in the sandbox; the message says why and what to do.
    """
    original = inspect.unwrap(function)  # under decorators that keep __wrapped__ (functools.wraps)
    name = getattr(original, "__name__", repr(original))
    if not inspect.isfunction(original):
        raise InvalidToolSpec(f"@sandboxed_tool takes a function defined with def, not {original!r}")
    if name == "<lambda>":
        raise InvalidToolSpec("@sandboxed_tool takes a function defined with def, not a lambda: it needs a name")
    if inspect.iscoroutinefunction(original) or inspect.isasyncgenfunction(original):
        raise InvalidToolSpec(f"@sandboxed_tool {name}: an async function cannot run in the sandbox, which calls "
                              "the function and returns its value: make it a plain def")  # fmt: skip
    if inspect.isgeneratorfunction(original):
        raise InvalidToolSpec(f"@sandboxed_tool {name}: a generator cannot run as a tool, whose output is the "
                              "function's JSON return value: return a list")  # fmt: skip
    # Its own name, for a recursive function defined in another: in the sandbox the def binds it.
    outer = [v for v in original.__code__.co_freevars if v != name]
    if outer:
        raise InvalidToolSpec(
            f"@sandboxed_tool {name} uses {_names(outer)} from the function that defines it; "
            "the sandbox runs the tool's own source only: define them inside it, or pass them as arguments"
        )
    node = _definition(original)
    node.decorator_list = []
    arguments = node.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg):
        if argument is not None:
            argument.annotation = None
    node.returns = None
    source = ast.unparse(ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))) + "\n"
    outside = _names_from_outside(source, name)
    if outside:
        raise InvalidToolSpec(
            f"@sandboxed_tool {name} uses {_names(outside)}, defined outside it (in its module, or imported "
            "there); the sandbox runs the tool's own source only, where they would raise NameError: "
            "import or define them inside the function"
        )
    compile(source, f"<tool {name}>", "exec")  # what the sandbox will do; a failure here is a bug of ours
    return source, name


def _definition(function: Any) -> ast.FunctionDef:
    """The ``def`` of ``function`` in its source file: the one of its name that starts (with its
    decorators) on the line its code starts."""
    filename = inspect.getsourcefile(function)
    lines = linecache.getlines(filename, function.__globals__) if filename else []
    if filename is None or not lines:
        raise InvalidToolSpec(f"@sandboxed_tool {function.__name__}: its source is not available (defined in an "
                              "interactive session, or by exec): define it in a file")  # fmt: skip
    try:
        tree = ast.parse("".join(lines), filename)
    except SyntaxError as exc:  # the code was compiled from something else (a document's snippet, say)
        raise InvalidToolSpec(f"@sandboxed_tool {function.__name__}: its source is not available ({filename} is "
                              "not the Python it was compiled from): define it in a file") from exc  # fmt: skip
    first = function.__code__.co_firstlineno
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function.__name__:
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if start == first:
                if "." in function.__qualname__.replace(".<locals>.", ""):
                    raise InvalidToolSpec(f"@sandboxed_tool {function.__qualname__}: a method cannot run in the "
                                          "sandbox: make it a plain function")  # fmt: skip
                return node
    raise InvalidToolSpec(f"@sandboxed_tool {function.__name__}: its definition is not in {filename} as loaded "
                          "(edited since?): reload the module")  # fmt: skip


def _names_from_outside(source: str, name: str) -> list[str]:
    """Names ``source`` (one function) reads that it does not define or import, other than builtins
    and the function's own name: in the sandbox, each would be a NameError."""
    found: set[str] = set()
    pending = [symtable.symtable(source, "<tool>", "exec")]
    while pending:
        table = pending.pop()
        pending.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_referenced() and symbol.is_global() and symbol.get_name() not in _BUILTINS:
                found.add(symbol.get_name())
    return sorted(found - {name})


def _schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The arguments' JSON Schema, from the signature's type hints (a parameter without one: any value)."""
    name = getattr(function, "__name__", "tool")
    try:
        signature = inspect.signature(function, eval_str=True)
    except NameError as exc:  # a hint imported under TYPE_CHECKING only, say
        raise InvalidToolSpec(f"@sandboxed_tool {name}: its type hints cannot be evaluated ({exc}): import what "
                              "they name in its module") from exc  # fmt: skip
    fields: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise InvalidToolSpec(f"@sandboxed_tool {name}: parameter {parameter} cannot be passed by name, as the "
                                  "sandbox passes arguments: declare each argument as a plain parameter")  # fmt: skip
        annotation = Any if parameter.annotation is parameter.empty else parameter.annotation
        if not _json_hint(annotation):
            raise InvalidToolSpec(
                f"@sandboxed_tool {name}: parameter {parameter.name!r} is typed {_hint_name(annotation)}, but the "
                "sandbox passes each argument as its plain JSON value (a dict, list, str, number, bool or null), "
                "never converted to that type: type it str, int, float, bool, None, list[...] (or Sequence[...]), "
                "dict[str, ...] (or Mapping[str, ...]), Literal[...], a TypedDict of those, or a union of them, "
                "and convert inside the function "
                "(datetime.date.fromisoformat(day), Color(color), tuple(pair) ...)"
            )
        fields[parameter.name] = (annotation, ... if parameter.default is parameter.empty else parameter.default)
    model = create_model(f"{name}_args", **fields)
    schema = TypeAdapter(model).json_schema()
    # An argument the function has no parameter for is the caller's mistake (InvalidCall naming it),
    # not a TypeError in the sandbox.
    return {k: v for k, v in schema.items() if k != "title"} | {"additionalProperties": False}


def _json_hint(hint: Any) -> bool:
    """Whether an argument so typed is its JSON value as it is: nothing converts it in the sandbox."""
    if any(hint is plain for plain in (*_JSON_SCALARS, *_SEQUENCES, *_MAPPINGS)):  # identity: some hints do not hash
        return True
    if isinstance(hint, typing.NewType):
        return _json_hint(hint.__supertype__)
    if is_typeddict(hint):
        return all(_json_hint(h) for h in typing.get_type_hints(hint).values())
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _json_hint(params[0])
    if origin is Literal:
        return all(p is None or type(p) in (str, int, bool) for p in params)
    if origin in (Union, types.UnionType):
        return all(_json_hint(p) for p in params)
    if any(origin is sequence for sequence in _SEQUENCES):
        return all(_json_hint(p) for p in params)
    if any(origin is mapping for mapping in _MAPPINGS):
        return len(params) == 2 and params[0] is str and _json_hint(params[1])
    return False


def _hint_name(hint: Any) -> str:
    return hint.__qualname__ if isinstance(hint, type) else repr(hint).replace("typing.", "")


def _names(names: Any) -> str:
    return ", ".join(repr(n) for n in names)
