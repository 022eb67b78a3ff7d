"""`sandboxed_tool`: whatever a formatter, a qualified name or another decorator does to the source,
the sandbox runs the function; what could not run there is refused when decorated, by name."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import pytest

import router.client
from router import ControlPlane
from router import client as sdk
from router.client import SandboxedTool, sandboxed_tool
from router.errors import InvalidToolSpec

LIMIT = 10
CALLED: list[str] = []


def counted(function: Callable[..., Any]) -> Callable[..., Any]:
    """A harmless decorator of the kind that gets stacked: it keeps ``__wrapped__``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        CALLED.append(function.__name__)
        return function(*args, **kwargs)

    return wrapper


def double(x: int) -> int:
    return 2 * x


@sandboxed_tool(
    risk="low",
    capabilities=[],
)
def word_count(text: str, minimum: int = 0) -> int:
    """Count the words in a text."""
    return max(minimum, len(text.split()))


@router.client.sandboxed_tool(risk="low")
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


@sdk.sandboxed_tool(risk="low")
@counted
def reverse(text: str) -> str:
    """Reverse a text."""
    return text[::-1]


@sandboxed_tool
def digest(text: str, algorithm: str = "sha256") -> str:
    """A hex digest of a text."""
    import hashlib  # noqa: PLC0415  (inside: the sandbox runs this function alone)

    return hashlib.new(algorithm, text.encode()).hexdigest()


def test_the_sandbox_gets_the_function_alone_without_decorators_or_annotations() -> None:
    assert word_count.spec.executor.source == (  # type: ignore[union-attr]
        "def word_count(text, minimum=0):\n"
        '    """Count the words in a text."""\n'
        "    return max(minimum, len(text.split()))\n"
    )
    for tool in (shout, reverse, digest):
        source = tool.spec.executor.source  # type: ignore[union-attr]
        assert source.startswith(f"def {tool.spec.name}(text")
        assert "@" not in source
    assert word_count["input_schema"]["required"] == ["text"]
    assert word_count.spec.description == "Count the words in a text."


def test_a_decorated_function_is_still_the_function_locally() -> None:
    assert isinstance(reverse, SandboxedTool)
    assert (word_count("a b c"), shout("hi"), reverse("abc")) == (3, "HI", "cba")
    assert CALLED[-1] == "reverse"  # the stacked decorator still runs locally
    assert digest("x") == hashlib.sha256(b"x").hexdigest()
    assert (reverse.__name__, reverse.__doc__) == ("reverse", "Reverse a text.")


async def test_each_runs_in_the_sandbox_and_returns_what_it_returns_locally(plane: ControlPlane) -> None:
    @sandboxed_tool(risk="low")
    def indented(words: list[str]) -> dict[str, int]:
        """Count each word (defined inside a test: indented in its file)."""
        import collections  # noqa: PLC0415  (inside: the sandbox runs this function alone)

        return dict(collections.Counter(words))

    cases = [(word_count, {"text": "one two three", "minimum": 1}, 3), (shout, {"text": "hi"}, "HI"),
             (reverse, {"text": "abc"}, "cba"), (digest, {"text": "x"}, hashlib.sha256(b"x").hexdigest()),
             (indented, {"words": ["a", "b", "a"]}, {"a": 2, "b": 1})]  # fmt: skip
    for tool, _, _ in cases:
        await plane.register(tool)
    session = await plane.open_session("agent-1", "alice@example.com")
    for tool, args, expected in cases:
        result = await plane.call(session, tool.spec.name, args)
        assert (result.status, result.verdict, result.tier) == ("completed", "ok", "bwrap"), result.stderr
        assert result.output == expected == tool(**args)


def test_a_name_from_the_module_is_refused_when_decorated_naming_it() -> None:
    with pytest.raises(InvalidToolSpec, match=r"doubled uses 'LIMIT', 'double', 'hashlib', defined outside it"):

        @sandboxed_tool()
        def doubled(x: int) -> str:
            return hashlib.sha256(str(min(double(x), LIMIT)).encode()).hexdigest()

    with pytest.raises(InvalidToolSpec, match=r"capped uses 'LIMIT'.*import or define them inside the function"):

        @sandboxed_tool()
        def capped(x: int = LIMIT) -> int:  # a default is evaluated where the function is defined
            return x


def test_a_closure_async_function_generator_or_lambda_is_refused_when_decorated() -> None:
    factor = 3
    with pytest.raises(InvalidToolSpec, match=r"scaled uses 'factor' from the function that defines it"):

        @sandboxed_tool()
        def scaled(x: int) -> int:
            return x * factor

    with pytest.raises(InvalidToolSpec, match=r"fetch: an async function cannot run in the sandbox"):

        @sandboxed_tool()
        async def fetch(url: str) -> str:
            return url

    with pytest.raises(InvalidToolSpec, match=r"numbers: a generator cannot run as a tool"):

        @sandboxed_tool()
        def numbers(n: int) -> Any:
            yield from range(n)

    with pytest.raises(InvalidToolSpec, match=r"not a lambda"):
        sandboxed_tool()(lambda x: x)


def test_a_function_without_source_in_a_file_is_refused() -> None:
    namespace: dict[str, Any] = {}
    exec("def echo(x):\n    return x\n", namespace)  # noqa: S102  (a function as a REPL or notebook would define it)
    with pytest.raises(InvalidToolSpec, match=r"echo: its source is not available"):
        sandboxed_tool()(namespace["echo"])


def test_a_malformed_spec_is_refused_naming_the_function_and_the_field() -> None:
    with pytest.raises(InvalidToolSpec, match=r"@sandboxed_tool shout2: invalid tool spec: risk: "):

        @sandboxed_tool(risk="extreme")
        def shout2(text: str) -> str:
            return text.upper()
