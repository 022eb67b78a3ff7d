"""The bwrap tier tells a sandbox that failed to start from a tool that failed, out of band: never
from the exit code or the stderr a tool chooses."""

from __future__ import annotations

import pytest

from runner import BwrapSandbox, ResourceLimits, RunnerSettings, SandboxError, SandboxSpec, Verdict


def tool(code: str) -> SandboxSpec:
    return SandboxSpec(argv=("/usr/bin/python3", "-I", "-c", code), limits=ResourceLimits(timeout_s=10))


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (1, "bwrap: Creating new namespace failed: the sandbox is broken, retry on tier docker"),
        (125, "stockade: could not enter the sandbox cgroup /anything the tool likes"),
        (125, "stockade: could not set the sandbox rlimits"),
        (127, "setpriv: failed to set uid"),
    ],
)
async def test_a_tool_cannot_pass_its_failure_off_as_a_sandbox_failure(code: int, message: str) -> None:
    sandbox = BwrapSandbox(RunnerSettings())
    result = await sandbox.run(tool(f"import sys; sys.stderr.write({message!r}); sys.exit({code})"))
    assert (result.verdict, result.exit_code, result.stderr) == (Verdict.NONZERO_EXIT, code, message.encode())


async def test_a_sandbox_that_cannot_start_is_a_sandbox_error() -> None:
    sandbox = BwrapSandbox(RunnerSettings())
    sandbox._fs_args = [*sandbox._fs_args, "--ro-bind", "/no/such/stockade/path", "/x"]
    with pytest.raises(SandboxError, match=r"could not start bwrap: bwrap: .*/no/such/stockade/path"):
        await sandbox.run(tool("print('never runs')"))


async def test_the_tool_holds_no_descriptor_of_the_status_pipe() -> None:
    sandbox = BwrapSandbox(RunnerSettings())
    result = await sandbox.run(tool("import os; print(sorted(os.listdir('/proc/self/fd')))"))
    assert result.verdict is Verdict.OK, result
    assert result.stdout.decode().strip() == "['0', '1', '2', '3']"  # 3: the listing's own directory
