"""Every fenced code block of README.md and docs/*.md, run or checked the way a reader following
the docs would: ``python`` blocks run as programs (against a real `stockade serve` when they talk
to one; an agent framework's LLM replaced by that framework's own test model), shell commands run
with their placeholders filled in, JSON parsed and validated (an MCP client's configuration is
started as that client would start it; reason-catalog entries validated), Rego accepted by
`stockade policy check` (beside the catalog entries its page shows); a command run elsewhere
(scripts/test and the benchmarks by .ci/run, `claude mcp add` by the wheel test) is checked to be
run there, and a diagram to be no code. A block that is none of these fails
`test_every_block_is_run_or_checked`: the docs cannot grow unverified snippets. Test ids name
the block: ``docs/interfaces.md#2-python`` is that file's second fenced block; a
shell block's commands are tested one by one (``README.md#4-sh:stockade policy test``).

What runs in place of the docs' placeholders:

- ``.venv/bin/stockade``, ``stockade``, ``/home/you/.local/bin/stockade`` ("what ``command -v
  stockade`` prints"): this checkout's ``.venv/bin/stockade``; every block runs in a temporary
  directory, with ``HOME`` a fresh directory (where the docs say state goes), no ``STOCKADE_*``
  settings but those the block needs (its own audit log; the SDK snippet's STOCKADE_URL,
  STOCKADE_TOKEN, STOCKADE_AGENT), and model APIs pointed at a closed loopback port.
- ``tools.json``, ``/path/to/tools.json``: a file listing `WORD_COUNT`, a python tool.
- ``in.json``: the PolicyInput of the call `stockade demo` saw denied (from the demo's audit log).
- ``candidate/``: a copy of policies/ whose catalog auto-allows only ``low`` risk.
- ``policies/`` (a policy directory to scaffold in or bundle): a copy of the shipped policies.
- ``signing.pem``, ``signing.pub``: an Ed25519 key pair made for the block (as its own
  ``openssl`` commands make one); ``policy.tar.gz``: the copy of policies/ built and signed with it.
- ``--session s-…``, ``--tool …``: that denied call's session and tool.
- ``a-…``: a call to `DROP_TABLE` held for a human in the running router.
- ``--port 8080`` and the ``--http`` port: a free loopback port.
- ``"token_sha256": "…"``: the sha256 of a fresh token for that principal.
- ``[--option value]``: optional arguments are given.

The python blocks under "Agent frameworks" use ``client``, ``session`` and ``approver`` as the docs
define them there (the agent's client, its session, a client with an approver's token; see
`run_fragment`) and top-level ``await``, as in ``python -m asyncio``.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents.testing import ScriptedModel, assistant_message, function_call
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from mcp import Client, StdioServerParameters
from pydantic import Field
from pydantic_ai import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from policy import PolicyBundleError, build_bundle, load_bundle
from policy.base import RATE_WINDOWS
from policy.schema import ReasonCatalog
from router.client import StockadeClient, SyncStockadeClient
from router.interfaces.api.app import PolicyStatus
from router.settings import ApiPrincipal
from router.tools import ToolSpec
from tests.conftest import REPO, copy_policies, edit_catalog, server_process, stockade_server

STOCKADE = Path(sys.executable).parent / "stockade"
DOC_FILES = ["README.md", *(f"docs/{doc.name}" for doc in sorted((REPO / "docs").glob("*.md")))]
SHELL = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")

WORD_COUNT: dict[str, Any] = {
    "name": "word_count", "description": "Count the words in a text.", "risk": "low",
    "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    "executor": {"kind": "python", "source": "def main(text):\n    return len(text.split())\n"},
}  # fmt: skip
# The held call of the "Agent frameworks" snippets (critical risk: always a human's decision).
DROP_TABLE: dict[str, Any] = {
    "name": "drop_table", "description": "Drop a table.", "risk": "critical", "capabilities": ["mutates_state"],
    "input_schema": {"type": "object", "properties": {"table": {"type": "string"}}, "required": ["table"]},
    "executor": {"kind": "python", "source": "def main(table):\n    return {'dropped': table}\n"},
}  # fmt: skip
REQUEST = "Drop the scratch table"  # what the user asks in the framework snippets
SCRATCH = {"table": "scratch"}


# -- the blocks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced code block: its file, its number there (from 1), the first word of its info
    string (``""`` for none), the line its text starts on, and the text."""

    file: str
    number: int
    lang: str
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"{self.file}#{self.number}-{self.lang or 'text'}"


def fenced_blocks(file: str) -> list[Block]:
    """The fenced code blocks of a Markdown file (backtick and tilde fences, CommonMark's rules)."""
    blocks: list[Block] = []
    opening: tuple[re.Match[str], int, list[str]] | None = None
    for number, line in enumerate((REPO / file).read_text().splitlines(), 1):
        if opening is None:
            if fence := FENCE.match(line):
                opening = (fence, number, [])
            continue
        fence, start, body = opening
        mark = fence["fence"]
        closing = line.strip()
        if closing.startswith(mark) and set(closing) == {mark[0]} and len(line) - len(line.lstrip()) < 4:
            lang = fence["info"].split()[0].lower() if fence["info"].strip() else ""
            blocks.append(Block(file, len(blocks) + 1, lang, start + 1, "".join(f"{b}\n" for b in body)))
            opening = None
        else:
            body.append(line.removeprefix(fence["indent"]))
    if opening is not None:
        raise ValueError(f"{file}:{opening[1]}: this code fence is never closed")
    return blocks


@dataclass(frozen=True)
class Command:
    """One command of a shell block, comments dropped and continued lines joined."""

    block: Block
    text: str
    words: tuple[str, ...]

    @property
    def name(self) -> str:
        """The program and subcommands, up to the first option or placeholder (``stockade policy
        test``; a ``.venv/bin/`` prefix left out)."""
        name: list[str] = []
        for word in self.words:
            head = word.removeprefix(".venv/bin/").split("=", 1)[0]  # `export NAME=value`: NAME
            if head.startswith(("-", "[")) or "…" in head:
                break
            name.append(head)
        return " ".join(name)

    def argv(self, fill: dict[str, str] | None = None, *, optional: bool = True) -> list[str]:
        """The words to run: optional ``[...]`` groups given (or left out), placeholders filled,
        ``.venv/bin/...`` made absolute (commands run outside the checkout)."""
        words: list[str] = []
        in_group = False
        for word in self.words:
            opens, closes = word.startswith("["), word.endswith("]") and (in_group or word.startswith("["))
            if (in_group or opens) and optional:
                words.append(word.removeprefix("[").removesuffix("]") if opens or closes else word)
            elif not (in_group or opens):
                words.append(word)
            in_group = (in_group or opens) and not closes
        words = [(fill or {}).get(w, w) for w in words]
        unfilled = [w for w in words if "…" in w]
        assert not unfilled, f"{self.block.id}: no value for the placeholders {unfilled} in {self.text!r}"
        return [str(REPO / w) if w.startswith(".venv/bin/") else w for w in words]


def shell_commands(block: Block) -> list[Command]:
    """The commands of a shell block (``console``: the lines after a ``$`` prompt)."""
    lines = block.text.splitlines()
    if block.lang == "console":
        lines = [line.removeprefix("$ ") for line in lines if line.startswith("$ ")]
    commands: list[Command] = []
    pending = ""
    for line in lines:
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            pending += "\n"
            continue
        if words:
            commands.append(Command(block, pending, tuple(words)))
        pending = ""
    assert not pending.strip(), f"{block.id}: an unfinished command: {pending!r}"
    return commands


# -- how each block is run ------------------------------------------------------------------------


@dataclass
class Context:
    """What a check may use: a temporary directory to work in, and the module's running router
    and demo run, started on first use."""

    request: pytest.FixtureRequest
    root: Path

    @property
    def server(self) -> Server:
        server: Server = self.request.getfixturevalue("server")
        return server

    @property
    def demo(self) -> DemoRun:
        demo: DemoRun = self.request.getfixturevalue("demo")
        return demo

    @property
    def cwd(self) -> Path:
        cwd = self.root / "cwd"
        if not cwd.exists():
            cwd.mkdir()
            (cwd / "tools.json").write_text(json.dumps([WORD_COUNT]))
        return cwd

    def env(self, **settings: str) -> dict[str, str]:
        return user_env(self.root / "home", settings)


def user_env(home: Path, settings: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a block runs in: this one without STOCKADE_* settings or model API keys,
    ``stockade`` on PATH, a fresh HOME, ``settings`` added. Model SDKs point at a closed loopback
    port and the Agents SDK does not export traces: nothing leaves the machine."""
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STOCKADE_", "XDG_", "OPENAI_", "ANTHROPIC_"))}  # fmt: skip
    env.update(HOME=str(home), PATH=f"{STOCKADE.parent}{os.pathsep}{env.get('PATH', '')}",
               OPENAI_BASE_URL="http://127.0.0.1:9/v1", OPENAI_AGENTS_DISABLE_TRACING="1")  # fmt: skip
    env.update(settings or {})
    return env


def execute(argv: list[str], ctx: Context, env: dict[str, str] | None = None, codes: tuple[int, ...] = (0,)) -> str:
    """Run a command in the block's directory; its stdout, once it exits with one of ``codes``."""
    done = subprocess.run(argv, check=False, cwd=ctx.cwd, env=env or ctx.env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode in codes, (
        f"{shlex.join(argv)} exited {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )
    return done.stdout


# -- the running router (one per module) --------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """`stockade serve` configured with the principals of docs/interfaces.md, holding `DROP_TABLE`."""

    url: str
    tokens: dict[str, str]
    principals: list[dict[str, Any]]
    env: dict[str, str]  # its settings: `stockade approvals` run with them finds it

    def name_of(self, role: str) -> str:
        """The principal of ``role`` (an agent: one that may register tools)."""
        return next(str(p["name"]) for p in self.principals
                    if p["role"] == role and (role != "agent" or p.get("may_register")))  # fmt: skip

    def clients(self) -> dict[str, tuple[str, str]]:
        """For `run_fragment`: each role's principal and token."""
        roles = ("agent", "approver", "auditor")
        return {role: (self.name_of(role), self.tokens[self.name_of(role)]) for role in roles}


def principals_command() -> Command:
    """The ``export STOCKADE_API_PRINCIPALS=...`` of docs/interfaces.md."""
    [command] = [c for b in fenced_blocks("docs/interfaces.md") if b.lang in SHELL for c in shell_commands(b)
                 if c.name == "export STOCKADE_API_PRINCIPALS"]  # fmt: skip
    return command


def filled_principals(command: Command, tokens: dict[str, str]) -> str:
    """The command's text with each ``"…"`` (a principal's token_sha256, in order) filled in."""
    documented = json.loads(command.words[1].split("=", 1)[1])
    text = command.text
    for principal in documented:
        text = text.replace('"…"', json.dumps(hashlib.sha256(tokens[principal["name"]].encode()).hexdigest()), 1)
    return text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    state = tmp_path_factory.mktemp("serve")
    command = principals_command()
    names = [p["name"] for p in json.loads(command.words[1].split("=", 1)[1])]
    tokens = {name: secrets.token_urlsafe(32) for name in names}
    principals = json.loads(shlex.split(filled_principals(command, tokens))[1].split("=", 1)[1])
    (state / "tools.json").write_text(json.dumps([DROP_TABLE]))
    env = {"STOCKADE_AUDIT__PATH": str(state / "audit.jsonl"), "STOCKADE_API_PRINCIPALS": json.dumps(principals),
           "STOCKADE_LOG_LEVEL": "error"}  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("STOCKADE_")]:  # as clean_environ, for the module
            patch.delenv(name)
        args = ["serve", "--tools", str(state / "tools.json")]
        with stockade_server(args, env, state / "serve.log", "/healthz") as url:
            yield Server(url, tokens, principals, env)


def hold_a_call(server: Server) -> str:
    """A call to drop_table held for a human in ``server``: its approval_id."""
    agent = server.name_of("agent")
    with SyncStockadeClient(server.url, server.tokens[agent], principal=agent) as client:
        session = client.open_session(agent, "alice@example.com", [REQUEST])
        held = client.call(session, "drop_table", SCRATCH)
    assert (held.status, held.approval_id is not None) == ("pending_approval", True), held
    return str(held.approval_id)


def approval_as_approver(server: Server, approval_id: str) -> dict[str, Any]:
    approver = server.name_of("approver")
    with SyncStockadeClient(server.url, server.tokens[approver], principal=approver) as client:
        return client.get_approval(approval_id).model_dump(mode="json")


# -- the demo (one run per module: its audit log is the one the audit and policy commands read) --


@dataclass(frozen=True)
class DemoRun:
    stdout: str
    log: Path

    def denied(self) -> dict[str, Any]:
        """The demo's denied call: its decision event."""
        events = [json.loads(line) for line in self.log.read_text().splitlines()]
        return next(e for e in events if (e["kind"], e["outcome"]) == ("decision", "deny"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """README's ``stockade demo``, run as written; it writes its audit log under ``HOME``."""
    home = tmp_path_factory.mktemp("demo")
    [command] = [c for b in fenced_blocks("README.md") if b.lang in SHELL for c in shell_commands(b)
                 if c.name == "stockade demo"]  # fmt: skip
    done = subprocess.run(command.argv(), check=False, cwd=home, env=user_env(home / "home"), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, f"stockade demo exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    [log] = (home / "home").glob(".local/state/stockade/demo/audit-*.jsonl")
    return DemoRun(done.stdout, log)


# -- python blocks: whole programs, and the framework snippets ------------------------------------


def is_program(block: Block) -> bool:
    """Whether a python block runs as a file as it is (no top-level ``await``)."""
    try:
        compile(block.text, block.id, "exec")
    except SyntaxError:
        return False
    return True


def run_program(block: Block, ctx: Context) -> None:
    """The block as a script file, run by this venv's python in a temporary directory, with the
    settings the SDK snippet reads (STOCKADE_URL, STOCKADE_TOKEN, STOCKADE_AGENT: an agent that
    may register tools) and an audit log of its own for an in-process control plane."""
    settings = {"STOCKADE_AUDIT__PATH": str(ctx.root / "audit.jsonl")}
    if "STOCKADE_URL" in block.text:
        server = ctx.server
        agent = server.name_of("agent")
        settings |= {"STOCKADE_URL": server.url, "STOCKADE_TOKEN": server.tokens[agent], "STOCKADE_AGENT": agent}
    script = ctx.cwd / "snippet.py"
    script.write_text(block.text)
    execute([sys.executable, str(script)], ctx, ctx.env(**settings))


@dataclass(frozen=True)
class Harness:
    """What a fragment ran with, for its check."""

    model: Any
    session: str
    auditor: StockadeClient
    home: Path


@dataclass(frozen=True)
class Fragment:
    """How to run a python block that is not a whole program: its test model (built fresh for the
    run), each text of the block replaced to run here, and what must hold after it ran. Each
    replaced text must occur in the block exactly once: the only changes from the docs."""

    marker: str  # a text only this block holds
    model: Callable[[], Any]
    standins: tuple[tuple[str, str], ...]
    check: Callable[[dict[str, Any], Harness], Awaitable[None]]

    def source(self, block: Block) -> str:
        text = block.text
        for docs, here in self.standins:
            assert text.count(docs) == 1, f"{block.id}: expected {docs!r} once in the block, to replace it"
            text = text.replace(docs, here)
        return text


class ScriptedChatModel(GenericFakeChatModel):
    """LangChain's fake chat model, which plays its messages in turn, accepting ``bind_tools``."""

    bound: list[str] = Field(default_factory=list)

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
        self.bound = [tool.name for tool in tools]
        return self


def langchain_model() -> ScriptedChatModel:
    drop = AIMessage(content="", tool_calls=[{"name": "drop_table", "args": SCRATCH, "id": "call-drop"}])
    return ScriptedChatModel(messages=iter([drop, AIMessage(content="dropped")]))


def pydantic_ai_model() -> FunctionModel:
    turns = [ModelResponse(parts=[ToolCallPart("drop_table", SCRATCH, tool_call_id="drop")]),
             ModelResponse(parts=[TextPart("dropped")])]  # fmt: skip

    def play(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return turns.pop(0)

    return FunctionModel(play)


def agents_model() -> ScriptedModel:
    return ScriptedModel([[function_call("drop_table", SCRATCH, call_id="drop")], [assistant_message("dropped")]])


def agents_mcp_model() -> ScriptedModel:
    return ScriptedModel([[function_call("word_count", {"text": "one two three"}, call_id="count")],
                          [assistant_message("three words")]])  # fmt: skip


async def held_call_ran_after_the_grant(harness: Harness) -> None:
    """The session's drop_table call was held, granted by the approver (note OPS-7), then run."""
    events = await harness.auditor.audit_events(session_id=harness.session, tool="drop_table")
    steps = [(e.kind, e.outcome) for e in events]
    assert steps[0] == ("decision", "require_approval"), steps
    [granted] = [e for e in events if (e.kind, e.outcome) == ("approval", "approved")]
    assert ((granted.result or {}).get("approver"), (granted.result or {}).get("note")) == ("oncall", "OPS-7")
    assert steps[-2:] == [("approval", "redeemed"), ("execution", "ok")], steps


async def langgraph_ran(ns: dict[str, Any], harness: Harness) -> None:
    assert "drop_table" in harness.model.bound
    messages = ns["state"]["messages"]
    [dropped] = [m for m in messages if isinstance(m, ToolMessage)]
    assert (dropped.status, json.loads(str(dropped.content))) == ("success", {"dropped": "scratch"})
    assert messages[-1].content == "dropped"
    await held_call_ran_after_the_grant(harness)


async def pydantic_ai_ran(ns: dict[str, Any], harness: Harness) -> None:
    assert ns["result"].output == "dropped"
    await held_call_ran_after_the_grant(harness)


async def agents_ran(ns: dict[str, Any], harness: Harness) -> None:
    assert (ns["result"].final_output, ns["result"].interruptions) == ("dropped", [])
    harness.model.assert_complete()
    await held_call_ran_after_the_grant(harness)


async def agents_mcp_ran(ns: dict[str, Any], harness: Harness) -> None:
    assert ns["result"].final_output == "three words"
    harness.model.assert_complete()
    shown = [item["output"] for call in harness.model.calls for item in call.input if isinstance(call.input, list)
             and isinstance(item, dict) and item.get("type") == "function_call_output"]  # fmt: skip
    [count] = shown  # the MCP tool's text content, as the SDK hands it to the model
    assert [part["text"] for part in count] == ["3"], count
    # The MCP server started without settings: its audit log is where README says it goes.
    log = harness.home / ".local/state/stockade/audit.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["kind"], e["outcome"], e["agent"]) for e in events if e["tool"] == "word_count"][-2:] == [
        ("decision", "allow", "openai-agent"), ("execution", "ok", "openai-agent")]  # fmt: skip


# The framework snippets of docs/interfaces.md. Their model is the framework's own test model
# (``test_model``), scripted to make the held call the snippet handles, then to answer.
FRAGMENTS = [
    Fragment("MCPServerStdio(", agents_mcp_model, (
        ('"/home/you/.local/bin/stockade"', json.dumps(str(STOCKADE))),
        ("mcp_servers=[stockade])", "mcp_servers=[stockade], model=test_model)"),
    ), agents_mcp_ran),
    Fragment("StateGraph(MessagesState)", langchain_model, (
        ("from langchain_openai import ChatOpenAI", ""),  # not installed here, and not used
        ('ChatOpenAI(model="gpt-4.1")', "test_model"),
    ), langgraph_ran),
    Fragment("pydantic_ai_toolset(", pydantic_ai_model, (('"openai:gpt-4.1"', "test_model"),), pydantic_ai_ran),
    Fragment("openai_agents_tools(", agents_model, (('model="gpt-4.1"', "model=test_model"),), agents_ran),
]  # fmt: skip


def fragment_of(block: Block) -> Fragment | None:
    found = [f for f in FRAGMENTS if f.marker in block.text]
    assert len(found) <= 1, f"{block.id} matches several fragments: {[f.marker for f in found]}"
    return found[0] if found else None


def run_fragment(file: str, number: int) -> None:
    """Run one framework snippet, in the process `run_fragment_block` starts: the block's text with
    its standins, top-level ``await`` allowed, ``client`` the agent's client, ``session`` a session
    it opened for `REQUEST`, ``approver`` the approver's client (docs/interfaces.md, "In the
    snippets, ..."). Tracebacks name the docs' own lines."""
    [block] = [b for b in fenced_blocks(file) if b.number == number]
    fragment = fragment_of(block)
    assert fragment is not None
    code = compile("\n" * (block.line - 1) + fragment.source(block), str(REPO / file), "exec",
                   flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)  # fmt: skip
    asyncio.run(_run_fragment(code, fragment))


async def _run_fragment(code: Any, fragment: Fragment) -> None:
    url, clients = os.environ["STOCKADE_URL"], json.loads(os.environ["DOCS_TEST_CLIENTS"])
    (agent, agent_token), (approver_name, approver_token) = clients["agent"], clients["approver"]
    async with (
        StockadeClient(url, agent_token, principal=agent) as client,
        StockadeClient(url, approver_token, principal=approver_name) as approver,
        StockadeClient(url, clients["auditor"][1], principal=clients["auditor"][0]) as auditor,
    ):
        session = await client.open_session(agent, "alice@example.com", [REQUEST])
        harness = Harness(fragment.model(), session, auditor, Path(os.environ["HOME"]))
        namespace = {"__name__": "__main__", "client": client, "session": session, "approver": approver,
                     "test_model": harness.model}  # fmt: skip
        running = eval(code, namespace)  # noqa: S307  (the docs' own snippet: what this test is for)
        if running is not None:
            await running
        await fragment.check(namespace, harness)


def run_fragment_block(block: Block, ctx: Context) -> None:
    """A framework snippet as a script file: `run_fragment` of this module, in a new process."""
    server = ctx.server
    script = ctx.cwd / "snippet.py"
    script.write_text(f"# {block.id}, as tests/test_docs.py runs it\nimport sys\n\n"
                      f"sys.path.insert(0, {str(REPO)!r})\nfrom tests.test_docs import run_fragment\n\n"
                      f"run_fragment({block.file!r}, {block.number})\n")  # fmt: skip
    settings = {"STOCKADE_URL": server.url, "DOCS_TEST_CLIENTS": json.dumps(server.clients())}
    execute([sys.executable, str(script)], ctx, ctx.env(**settings))


# -- shell commands -------------------------------------------------------------------------------


def demo_ran(command: Command, ctx: Context) -> None:
    assert "demo complete: every step behaved as described" in ctx.demo.stdout


def policy_test(command: Command, ctx: Context) -> None:
    """With ``--json``: every test passed and coverage names the entrypoint; as a table: the
    summary says nothing failed and the RVM agreed on every input; with ``-r``, only tests the
    regex matches ran; with ``-v``, each passing test shows its RVM replay."""
    said = execute(command.argv(), ctx)
    if "--json" not in command.words and "[--json]" not in command.words:
        summary = re.search(r"^(\d+) passed, 0 failed; .* 0 disagree", said, re.MULTILINE)
        assert summary is not None, said
        assert int(summary[1]) > 0, said
        if "--coverage" in command.words:
            assert re.search(r"^coverage stockade/decision\.rego: ", said, re.MULTILINE), said
        ran = re.findall(r"^PASS (\S+)(.*)$", said, re.MULTILINE)
        if "-r" in command.words:  # matched against data.<package>.<name> or file::name
            pattern = command.words[command.words.index("-r") + 1]
            everything = execute([str(STOCKADE), "policy", "test"], ctx)
            assert len(ran) < len(re.findall(r"^PASS ", everything, re.MULTILINE)), said
            assert all(re.search(pattern, name) for name, _ in ran), said
        if "-v" in command.words:
            assert all(re.match(r" \([\d.]+ ms; RVM agrees on \d+ inputs?\)", rest) for _, rest in ran), said
        return
    report = json.loads(said)
    assert report["tests"], "no Rego tests ran"
    assert all(t["passed"] for t in report["tests"]), [t for t in report["tests"] if not t["passed"]]
    assert {c["file"] for c in report["coverage"]} >= {"stockade/decision.rego"}


def write_denied_input(ctx: Context) -> dict[str, Any]:
    """``in.json``: the input of the demo's denied call; returns its decision event."""
    denied = ctx.demo.denied()
    (ctx.cwd / "in.json").write_text(json.dumps(denied["input"]))
    return denied


def policy_eval(command: Command, ctx: Context) -> None:
    """The decision of the demo's denied call, as recorded; given ``deny_reasons``, that rule's
    value: the recorded reasons."""
    denied = write_denied_input(ctx)
    if "deny_reasons" in command.words:
        reasons = json.loads(execute(command.argv(), ctx))
        assert [r["code"] for r in reasons] == [r["code"] for r in denied["result"]["reasons"]], reasons
        return
    assert command.name == "stockade policy eval", f"{command.text!r}: no check for this rule"
    decision = json.loads(execute(command.argv(), ctx))
    assert decision["outcome"] == denied["result"]["outcome"] == "deny"
    assert [r["code"] for r in decision["reasons"]] == [r["code"] for r in denied["result"]["reasons"]]


def policy_explain(command: Command, ctx: Context) -> None:
    denied = write_denied_input(ctx)
    said = execute(command.argv(), ctx)
    assert "outcome: deny" in said
    for reason in denied["result"]["reasons"]:
        assert re.search(re.escape(reason["code"]) + r".*\(stockade/\w+\.rego:\d+\)", said), said


def policy_check(command: Command, ctx: Context) -> None:
    assert execute(command.argv(), ctx).startswith("OK ")


def policy_replay(command: Command, ctx: Context) -> None:
    """``candidate/`` narrows the shipped policy, so a gate on widened changes passes; ``policies/``
    (a ``--baseline``) is the shipped policy."""
    edit_catalog(copy_policies(ctx.cwd).rename(ctx.cwd / "candidate"), auto_allow_risks=["low"])
    if "policies/" in command.words:
        copy_policies(ctx.cwd)
    said = execute(command.argv(), ctx, ctx.env(STOCKADE_AUDIT__PATH=str(ctx.demo.log)))
    summary = re.search(r"(\d+) decisions replayed, (\d+) would change", said)
    assert summary is not None, said
    assert int(summary[2]) >= 1, said  # the demo's medium-risk calls
    assert "policy.default_deny" in said


def policy_new(command: Command, ctx: Context) -> None:
    """In a copy of the shipped ``policies/``: the area's rule, its tests (which pass) and its
    reason code, and the directory still checks; a second run overwrites nothing (exit 2)."""
    assert "policies/" in command.words, command.text
    root = copy_policies(ctx.cwd)
    area = command.words[command.words.index("new") + 1]
    execute(command.argv(), ctx)
    assert (root / "stockade" / f"{area}.rego").is_file()
    assert (root / "stockade" / f"{area}_test.rego").is_file()
    assert f"{area}.example" in json.loads((root / "stockade" / "reasons" / "data.json").read_text())
    said = execute([str(STOCKADE), "policy", "test", "--dir", str(root), "-r", area], ctx)
    assert re.search(r"^2 passed, 0 failed", said, re.MULTILINE), said
    assert execute([str(STOCKADE), "policy", "check", "--dir", str(root)], ctx).startswith("OK ")
    rule = (root / "stockade" / f"{area}.rego").read_text()
    execute(command.argv(), ctx, codes=(2,))
    assert (root / "stockade" / f"{area}.rego").read_text() == rule


def policy_schema(command: Command, ctx: Context) -> None:
    """The input contract: the subject's groups and labels, the environment, every rate window;
    with ``--tools``, each tool's args schema under its name."""
    schema = json.loads(execute(command.argv(), ctx))
    fields = schema["properties"]
    assert {"groups", "labels"} <= set(fields["subject"]["properties"])
    assert set(fields["environment"]["properties"]) == {"name", "instance"}
    assert "labels" in fields["session"]["properties"]
    assert set(fields["rate"]["properties"]) == set(RATE_WINDOWS)
    if "tools.json" in command.words:
        [per_tool] = schema["allOf"]
        assert per_tool["if"]["properties"]["tool"]["properties"]["name"] == {"const": WORD_COUNT["name"]}
        assert per_tool["then"]["properties"]["args"] == WORD_COUNT["input_schema"]


def policy_bench(command: Command, ctx: Context) -> None:
    """The production path, the baseline, and a line for each shipped rule area."""
    said = execute(command.argv(), ctx)
    assert re.search(r"^  decision \(production path\) +\d+ +[\d.]+ +[\d.]+", said, re.MULTILINE), said
    assert "baseline: one-rule policy" in said
    areas = sorted(f.name for f in (REPO / "policies" / "stockade").glob("*.rego") if not f.stem.endswith("_test"))
    assert areas == sorted(re.findall(r"^ +stockade/(\w+\.rego) ", said, re.MULTILINE)), said


def signing_key(ctx: Context) -> Ed25519PrivateKey:
    """``signing.pem`` in the block's directory (made as ``openssl genpkey`` makes it, if missing)."""
    pem = ctx.cwd / "signing.pem"
    if not pem.exists():
        made = Ed25519PrivateKey.generate()
        pem.write_bytes(made.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    key = serialization.load_pem_private_key(pem.read_bytes(), password=None)
    assert isinstance(key, Ed25519PrivateKey), f"{pem} is not an Ed25519 private key"
    return key


def public_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def openssl_genpkey(command: Command, ctx: Context) -> None:
    """An Ed25519 private key, in PEM, where the command says."""
    execute(command.argv(), ctx)
    signing_key(ctx)


def openssl_pkey(command: Command, ctx: Context) -> None:
    """``signing.pub``: the public half of ``signing.pem``, in PEM."""
    key = signing_key(ctx)
    execute(command.argv(), ctx)
    assert (ctx.cwd / "signing.pub").read_bytes() == public_pem(key.public_key())


def policy_build(command: Command, ctx: Context) -> None:
    """``policy.tar.gz``: ``policies/`` signed with ``signing.pem`` under the revision given; it
    loads with that key's public half, and with no other key."""
    key = signing_key(ctx)
    root = copy_policies(ctx.cwd)
    execute(command.argv(), ctx)
    bundle = load_bundle(ctx.cwd / "policy.tar.gz", public_key=key.public_key())
    revision = command.words[command.words.index("--revision") + 1]
    assert bundle.revision == f"{revision}+{load_bundle(root).content_hash}"
    with pytest.raises(PolicyBundleError):
        load_bundle(ctx.cwd / "policy.tar.gz", public_key=Ed25519PrivateKey.generate().public_key())


def policy_verify_bundle(command: Command, ctx: Context) -> None:
    """A bundle signed with ``signing.pem`` verifies with ``signing.pub``; with another key it does not."""
    key = signing_key(ctx)
    (ctx.cwd / "signing.pub").write_bytes(public_pem(key.public_key()))
    built = build_bundle(copy_policies(ctx.cwd), ctx.cwd / "policy.tar.gz", revision="v42", signing_key=key)
    said = execute(command.argv(), ctx)
    assert said.startswith(f"verified policy.tar.gz: revision {built.revision}"), said
    (ctx.cwd / "signing.pub").write_bytes(public_pem(Ed25519PrivateKey.generate().public_key()))
    execute(command.argv(), ctx, codes=(1,))


def audit_verify(command: Command, ctx: Context) -> None:
    # As the user who ran the demo (its HOME holds the signing key whose public half verify checks
    # the checkpoints with): without a public key, verify refuses to call a log intact.
    home = ctx.demo.log.parents[4]  # <home>/.local/state/stockade/demo/audit-….jsonl
    report = json.loads(execute(command.argv(), ctx, user_env(home, {"STOCKADE_AUDIT__PATH": str(ctx.demo.log)})))
    assert (report["ok"], report["events"]) == (True, len(ctx.demo.log.read_text().splitlines()))


def audit_query(command: Command, ctx: Context) -> None:
    denied = ctx.demo.denied()
    argv = command.argv({"s-…": denied["session_id"], "…": denied["tool"]})
    said = execute(argv, ctx, ctx.env(STOCKADE_AUDIT__PATH=str(ctx.demo.log)))
    events = [json.loads(line) for line in said.splitlines() if line.strip()]  # --json: one event per line
    assert denied["decision_id"] in [e["decision_id"] for e in events]
    assert {(e["session_id"], e["tool"], e["outcome"]) for e in events} == {
        (denied["session_id"], denied["tool"], "deny")}  # fmt: skip


def approvals_list(command: Command, ctx: Context) -> None:
    approval_id = hold_a_call(ctx.server)
    listed = json.loads(execute(command.argv(), ctx, ctx.env(**ctx.server.env)))
    assert approval_id in [a["id"] for a in listed]
    assert {a["status"] for a in listed} == {"pending"}


def approvals_show(command: Command, ctx: Context) -> None:
    approval_id = hold_a_call(ctx.server)
    said = execute(command.argv({"a-…": approval_id}), ctx, ctx.env(**ctx.server.env))
    assert approval_id in said
    assert "drop_table" in said
    assert "scratch" in said


def approvals_approve(command: Command, ctx: Context) -> None:
    """``approve``, then the comment's ``deny`` with the same arguments, each on a held call."""
    for decision, status in [("approve", "approved"), ("deny", "denied")]:
        approval_id = hold_a_call(ctx.server)
        argv = [decision if word == "approve" else word for word in command.argv({"a-…": approval_id})]
        execute(argv, ctx, ctx.env(**ctx.server.env))
        approval = approval_as_approver(ctx.server, approval_id)
        assert (approval["status"], approval["approver"], approval["note"]) == (status, "oncall", "OPS-7")


def serve(command: Command, ctx: Context) -> None:
    argv = command.argv(optional=False)  # server_process gives it a free --port
    log = ctx.root / "serve.log"
    with server_process(argv, log, "/healthz", ctx.env(STOCKADE_AUDIT__PATH=str(ctx.root / "audit.jsonl"))) as url:
        assert httpx.get(f"{url}/openapi.json").json()["openapi"].startswith("3.1")


async def use_mcp_server(client: Client) -> None:
    """What an MCP client does with the tools file's word_count: list it, call it."""
    assert [tool.name for tool in (await client.list_tools()).tools] == ["word_count"]
    counted = await client.call_tool("word_count", {"text": "one two three"})
    assert (counted.is_error, counted.content[0].text) == (False, "3")  # type: ignore[union-attr]


def mcp(command: Command, ctx: Context) -> None:
    """Over stdio, as an MCP client starts it; then with ``--http`` (on a free port)."""
    stdio = command.argv(optional=False)
    params = StdioServerParameters(command=stdio[0], args=stdio[1:], env={"HOME": str(ctx.root / "home")},
                                   cwd=ctx.cwd)  # fmt: skip
    asyncio.run(mcp_session(Client(params)))
    http = command.argv({"tools.json": str(ctx.cwd / "tools.json")})  # server_process runs it from the checkout
    with server_process(http, ctx.root / "mcp.log", "/mcp", ctx.env()) as url:
        asyncio.run(mcp_session(Client(f"{url}/mcp")))


async def mcp_session(client: Client) -> None:
    async with client:
        await use_mcp_server(client)


def api_token(command: Command, ctx: Context) -> None:
    made = json.loads(execute(command.argv(), ctx))
    assert made["token_sha256"] == hashlib.sha256(made["token"].encode()).hexdigest()


def sandbox_doctor(command: Command, ctx: Context) -> None:
    done = subprocess.run(command.argv(), check=False, cwd=ctx.cwd, env=ctx.env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    report = json.loads(done.stdout)
    assert set(report) == {"bwrap", "docker", "gvisor"}
    assert done.returncode == (0 if all(tier["available"] for tier in report.values()) else 1), done


def sandbox_build_image(command: Command, ctx: Context) -> None:
    """Once per recipe: scripts/test built this recipe's image, so this finds it and builds nothing
    (nothing is fetched); its tag is the one the docker tier runs."""
    tag = execute(command.argv(), ctx).strip()
    assert tag.startswith("stockade-sandbox:recipe-"), tag
    images = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=60, check=False)
    assert images.returncode == 0, images.stderr


def _pins(lock: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", lock.read_text(), re.MULTILINE))


def scripts_demo(command: Command, ctx: Context) -> None:
    """The README's first command, from the checkout, after the tests' own set-up: it installs
    the runtime lock into the same .venv (which must change none of the test tools' versions:
    every runtime pin is the dev lock's) and the demo passes."""
    runtime, dev = _pins(REPO / "requirements.lock"), _pins(REPO / "requirements-dev.lock")
    assert {name: (version, dev.get(name)) for name, version in runtime.items() if dev.get(name) != version} == {}
    done = subprocess.run(["bash", str(REPO / command.words[0])], check=False, cwd=REPO, env=ctx.env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "demo complete: every step behaved as described" in done.stdout
    assert (ctx.root / "home" / ".local" / "state" / "stockade" / "demo").is_dir()  # state under HOME


def principals_export(command: Command, ctx: Context) -> None:
    """The export, ``"…"`` filled with hashes, run by bash: each entry a valid `ApiPrincipal`,
    and what the module's router runs with."""
    server = ctx.server
    script = filled_principals(command, server.tokens) + "\nprintenv STOCKADE_API_PRINCIPALS\n"
    exported = json.loads(execute(["bash", "-euc", script], ctx))
    principals = [ApiPrincipal.model_validate(p) for p in exported]
    assert {p.role for p in principals} == {"agent", "approver", "auditor", "admin"}
    assert exported == server.principals


# Each command of a shell block is run by the check named for it here (the longest entry its name
# starts with: ``stockade policy eval deny_reasons`` by ``stockade policy eval``'s), or skipped below.
COMMANDS: dict[str, Callable[[Command, Context], None]] = {
    "stockade demo": demo_ran,
    "stockade policy test": policy_test,
    "stockade policy eval": policy_eval,
    "stockade policy explain": policy_explain,
    "stockade policy check": policy_check,
    "stockade policy replay": policy_replay,
    "stockade policy new": policy_new,
    "stockade policy schema": policy_schema,
    "stockade policy bench": policy_bench,
    "stockade policy build": policy_build,
    "stockade policy verify-bundle": policy_verify_bundle,
    "openssl genpkey": openssl_genpkey,
    "openssl pkey": openssl_pkey,
    "stockade audit verify": audit_verify,
    "stockade audit query": audit_query,
    "stockade approvals list": approvals_list,
    "stockade approvals show": approvals_show,
    "stockade approvals approve": approvals_approve,
    "stockade serve": serve,
    "stockade mcp": mcp,
    "stockade api-token": api_token,
    "stockade sandbox doctor": sandbox_doctor,
    "stockade sandbox build-image": sandbox_build_image,
    "scripts/demo": scripts_demo,
    "export STOCKADE_API_PRINCIPALS": principals_export,
}


def ci_runs(command: Command) -> None:
    """A command CI runs itself: .ci/run has a line running it (scripts/test, each benchmark)."""
    target = next(w for w in command.words if w.startswith(("scripts/", "bench/")))
    assert (REPO / target).exists(), f"{command.text!r} names {target}, which does not exist"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert any(target in line.split() or f"bin/python {target}" in line for line in ci), f".ci/run never runs {target}"


def wheel_test_runs(command: Command) -> None:
    """`claude mcp add` needs Claude Code: tests/test_wheel_install.py runs this very line (read from
    the docs) with a stand-in `claude`, against the installed wheel, from /."""
    assert "claude mcp add" in (REPO / "tests" / "test_wheel_install.py").read_text()


# Commands run elsewhere (by the start of their name): the check that the other place runs them.
# scripts/test runs the whole suite, this test included; the benchmarks run for minutes after it.
RUN_ELSEWHERE: dict[str, Callable[[Command], None]] = {
    "scripts/test": ci_runs,
    "python bench/": ci_runs,
    "claude mcp add": wheel_test_runs,
}


def not_code(block: Block) -> None:
    """A diagram: a fence without a language, nothing to run."""
    assert block.lang == "", f"{block.id} has a language: run or check it"


# Blocks that are not code at all (by a marker in their text).
NOT_CODE = {("README.md", "agent ─► ControlPlane.call")}


# -- JSON and Rego ----------------------------------------------------------------------------------


def check_json(block: Block, ctx: Context) -> None:
    """JSON blocks parse; what they describe is checked by its shape: an MCP client's
    configuration is started as that client would, a tool spec is a `ToolSpec`, principals are
    `ApiPrincipal`s, a ``GET /v1/policy`` answer a `PolicyStatus`."""
    document = json.loads(block.text)
    if isinstance(document, dict) and "mcpServers" in document:
        check_mcp_client_config(document, ctx)
        return
    items = document if isinstance(document, list) else [document]
    if all(isinstance(i, dict) and {"name", "executor"} <= set(i) for i in items):
        for item in items:
            ToolSpec.model_validate(item)
    elif all(isinstance(i, dict) and "token_sha256" in i for i in items):
        for item in items:
            ApiPrincipal.model_validate(item | {"token_sha256": "0" * 64})
    elif is_reason_catalog(document):
        ReasonCatalog.model_validate(document)
    elif isinstance(document, dict) and {"in_force", "on_disk"} <= set(document):
        PolicyStatus.model_validate(document)  # GET /v1/policy's answer
    else:
        pytest.fail(f"{block.id}: no check for this JSON; add one to check_json")


def check_mcp_client_config(document: dict[str, Any], ctx: Context) -> None:
    """Each server as the client starts it (``/home/you/.local/bin/stockade``: this stockade)."""
    for server in document["mcpServers"].values():
        assert isinstance(server["command"], str)
        assert all(isinstance(arg, str) for arg in server["args"])
        command = str(STOCKADE) if server["command"] == "/home/you/.local/bin/stockade" else server["command"]
        args = [str(ctx.cwd / "tools.json") if arg == "/path/to/tools.json" else arg for arg in server["args"]]
        params = StdioServerParameters(command=command, args=args, env={"HOME": str(ctx.root / "home")})
        asyncio.run(mcp_session(Client(params)))


def check_rego(block: Block, ctx: Context) -> None:
    """A Rego block is accepted by `stockade policy check` as a module beside the shipped policy:
    a rule of ``package stockade`` in policies/stockade/ with the reason-catalog entries the same
    page shows, a test package as a ``_test.rego`` file, a fragment without a ``package`` in a
    package of its own."""
    policies = copy_policies(ctx.root / f"rego-{block.number}")
    package = re.search(r"^package ([\w.]+)", block.text, re.MULTILINE)
    module = block.text if package else f"package docs\n\n{block.text}"
    folder = policies / ("stockade" if package and package[1].startswith("stockade") else "docs")
    folder.mkdir(exist_ok=True)
    suffix = "_test" if package and package[1].endswith("_test") else ""
    (folder / f"docs_block_{block.number}{suffix}.rego").write_text(module)
    page = fenced_blocks(block.file) if (REPO / block.file).exists() else []
    entries = [e for b in page if b.lang == "json" and is_reason_catalog(e := json.loads(b.text))]
    if entries:
        catalog = policies / "stockade" / "reasons" / "data.json"
        merged = json.loads(catalog.read_text())
        for entry in entries:
            merged |= entry
        catalog.write_text(json.dumps(merged))
    execute([str(STOCKADE), "policy", "check", "--dir", str(policies)], ctx)


def is_reason_catalog(document: Any) -> bool:
    """Entries of ``data.stockade.reasons``: an object of codes, each with an outcome."""
    return (
        isinstance(document, dict)
        and bool(document)
        and all(isinstance(v, dict) and "outcome" in v for v in document.values())
    )


# -- the cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One test: a block (a shell block: one of its commands), how it is run, or why it is not."""

    id: str
    block: Block
    run: Callable[[Context], None] | None = None
    problem: str = ""
    uses: list[str] = field(default_factory=list)  # the table entries it uses (for the stale check)


def plan(block: Block) -> list[Case]:
    for file, marker in NOT_CODE:
        if block.file == file and marker in block.text:
            return [Case(block.id, block, lambda _: not_code(block), uses=[f"block {file} {marker}"])]
    if block.lang == "python":
        if is_program(block):
            return [Case(block.id, block, lambda ctx: run_program(block, ctx))]
        fragment = fragment_of(block)
        if fragment is None:
            return [Case(block.id, block, problem="uses top-level await but matches no FRAGMENTS entry: add one "
                         "(its names, its model, what must hold after it), or make it a whole program")]  # fmt: skip
        return [Case(block.id, block, lambda ctx: run_fragment_block(block, ctx), uses=[f"fragment {fragment.marker}"])]
    if block.lang in SHELL:
        return [command_case(command) for command in shell_commands(block)]
    if block.lang == "json":
        return [Case(block.id, block, lambda ctx: check_json(block, ctx))]
    if block.lang == "rego":
        return [Case(block.id, block, lambda ctx: check_rego(block, ctx))]
    return [Case(block.id, block, problem=f"no check for ```{block.lang or '(no language)'} blocks: add one to "
                 "tests/test_docs.py, or a skip with its reason")]  # fmt: skip


def command_case(command: Command) -> Case:
    case_id = f"{command.block.id}:{command.name}"
    named = [name for name in COMMANDS if f"{command.name} ".startswith(f"{name} ")]
    if named:
        name = max(named, key=len)
        runs = COMMANDS[name]
        return Case(case_id, command.block, lambda ctx: runs(command, ctx), uses=[f"command {name}"])
    elsewhere = next(((prefix, shown) for prefix, shown in RUN_ELSEWHERE.items() if command.name.startswith(prefix)),
                     None)  # fmt: skip
    if elsewhere is not None:
        prefix, shown = elsewhere
        return Case(case_id, command.block, lambda _: shown(command), uses=[f"elsewhere {prefix}"])
    return Case(case_id, command.block, problem=f"{command.text!r} is neither run here (COMMANDS) nor shown to run "
                "elsewhere (RUN_ELSEWHERE)")  # fmt: skip


BLOCKS = [block for file in DOC_FILES for block in fenced_blocks(file)]
CASES = [case for block in BLOCKS for case in plan(block)]


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A temporary directory with a short path: HOME goes in it, and the approval socket a router
    makes under HOME must fit in the 108 bytes of a unix socket's address (pytest's tmp_path may not)."""
    root = Path(tempfile.mkdtemp(prefix="docs-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_docs_snippet_works_as_documented(case: Case, request: pytest.FixtureRequest, workdir: Path) -> None:
    assert not case.problem, f"{case.id}: {case.problem}"
    assert case.run is not None
    case.run(Context(request, workdir))


def test_every_block_is_run_or_checked() -> None:
    """No block or command goes unverified, and no entry of the tables names one that is gone."""
    unplanned = [f"{case.id}: {case.problem}" for case in CASES if case.problem]
    assert not unplanned, "\n".join(unplanned)
    used = {use for case in CASES for use in case.uses}
    entries = {f"command {name}" for name in COMMANDS} | {f"elsewhere {prefix}" for prefix in RUN_ELSEWHERE}
    entries |= {f"fragment {f.marker}" for f in FRAGMENTS} | {f"block {f} {m}" for f, m in NOT_CODE}
    assert entries <= used, f"entries for snippets the docs no longer have: {sorted(entries - used)}"
    assert len({case.id for case in CASES}) == len(CASES), "two cases share an id"


def test_a_rego_block_is_checked_by_stockade_policy_check(request: pytest.FixtureRequest, workdir: Path) -> None:
    """The check a Rego block gets accepts a rule and refuses a builtin regorus lacks."""
    ctx = Context(request, workdir)
    check_rego(Block("docs/x.md", 1, "rego", 1, "is_broad if count(input.tool.capabilities) > 3\n"), ctx)
    with pytest.raises(AssertionError, match=r"regex\.globs_match"):
        check_rego(Block("docs/x.md", 2, "rego", 1, 'odd if regex.globs_match("a", "b")\n'), ctx)


# -- what the docs must name: every command's options, every HTTP operation --------------------------


def doc_sections() -> list[str]:
    """Each section of README.md and docs/*.md (a heading to the next, headings inside fenced blocks
    not counted), with its whitespace collapsed: what one place in the docs says together."""
    sections: list[str] = []
    for file in DOC_FILES:
        current: list[str] = []
        fence: str | None = None
        for line in (REPO / file).read_text().splitlines():
            found = FENCE.match(line)
            if found and fence is None:
                fence = found["fence"]
            elif found and fence is not None and found["fence"][0] == fence[0] and len(found["fence"]) >= len(fence):
                fence = None
            elif fence is None and re.match(r"#{1,6} ", line):
                sections.append(" ".join(" ".join(current).split()))
                current = []
            current.append(line)
        sections.append(" ".join(" ".join(current).split()))
    return sections


def cli_options() -> Iterator[tuple[str, list[str]]]:
    """Each option of each ``stockade`` command: the command (``audit export``) and the option's names."""
    import typer  # noqa: PLC0415

    from router.interfaces.cli import app  # noqa: PLC0415

    def walk(command: Any, path: list[str]) -> Iterator[tuple[str, list[str]]]:
        if hasattr(command, "commands"):  # a group (typer's own click, not the click package's classes)
            for name, sub in command.commands.items():
                yield from walk(sub, [*path, name])
            return
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden and param.name != "help":
                yield " ".join(path), [*param.opts, *param.secondary_opts]

    yield from walk(typer.main.get_command(app), [])


def test_every_option_of_every_command_is_described_where_the_command_is() -> None:
    """An option `--help` shows is named in a section of the docs that names its command
    (``stockade serve``; ``audit export``; a report's group, ``audit report``), so no option is only
    discoverable by reading the code."""
    sections = doc_sections()
    missing = set()
    for command, names in cli_options():
        # A top-level command's name alone is a common word (`demo`, `serve`); a report is named by its group too.
        words = command.split()
        callers = [f"stockade {command}"] if len(words) == 1 else [command, " ".join(words[:2])]
        named = [re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])") for name in names]
        if not any(any(c in text for c in callers) and any(n.search(text) for n in named) for text in sections):
            missing.add((command, max(names, key=len)))
    assert missing == set(), f"options no doc describes beside their command: {sorted(missing)}"


async def test_every_http_operation_is_in_docs_interfaces(tmp_path: Path) -> None:
    """docs/interfaces.md lists every operationId (and no other), and names every route that takes
    no path parameter (its roles table, its prose)."""
    from router import ControlPlane, Settings  # noqa: PLC0415
    from router.interfaces.api import create_app  # noqa: PLC0415
    from router.settings import AuditSettings  # noqa: PLC0415

    async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"))) as plane:
        schema = create_app(plane).openapi()
    text = (REPO / "docs" / "interfaces.md").read_text()
    listed = re.search(r"OperationIds are [^:]*:(.*?);", text, re.DOTALL)
    assert listed is not None, "docs/interfaces.md no longer lists the operationIds"
    operations = {op["operationId"] for route in schema["paths"].values() for op in route.values()}
    assert set(re.findall(r"`(\w+)`", listed.group(1))) == operations
    plain = [path for path in schema["paths"] if "{" not in path]
    unnamed = [path for path in plain if not re.search(rf"{re.escape(path)}(?![\w/-])", text)]
    assert unnamed == [], f"routes docs/interfaces.md does not name: {unnamed}"
