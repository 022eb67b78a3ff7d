"""The reason-code catalog: every code a decision may carry, with the outcome it leads to, what it
means and what to do about it.

The catalog is data, ``data.stockade.reasons`` (``policies/stockade/reasons/data.json``); rules
give a code, the catalog says what it means. It covers the codes the router sets itself
(``policy.error``, ``audit.unavailable``, ...) too, so one table documents every code an agent or
an auditor can see. ``stockade policy check`` enforces that each code a rule gives is catalogued;
the reason-code table of docs/policy.md is rendered from here (``scripts/policy-docs``), never
written by hand.

Usage: python -m policy.reasons [--doc docs/policy.md] [--dir policies] [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from policy.bundle import PolicyBundle, load_bundle
from policy.errors import PolicyBundleError
from policy.schema import ReasonCatalog, ReasonEntry

START = "<!-- reason-codes:start -->"
END = "<!-- reason-codes:end -->"
# A reason object with a literal code, as rules write it: {"code": "rate.exceeded", ...}.
_CODE_LITERAL = re.compile(r'"code"\s*:\s*"([^"\\]+)"')


@dataclass(frozen=True, slots=True)
class CataloguedReason:
    """One catalog entry, and the rule files that give its code (none: the router sets it)."""

    code: str
    entry: ReasonEntry
    files: tuple[str, ...]


def load_reasons(bundle: PolicyBundle) -> dict[str, ReasonEntry]:
    """The bundle's ``data.stockade.reasons``, validated.

    Raises:
        PolicyBundleError: the catalog is missing or an entry is malformed (the message names
            the code and the field).
    """
    raw = bundle.data.get("stockade", {}).get("reasons")
    if raw is None:
        raise PolicyBundleError(
            f"{bundle.root}: no data.stockade.reasons; add stockade/reasons/data.json with an entry per reason code"
        )
    try:
        return ReasonCatalog.model_validate(raw).root
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise PolicyBundleError(f"stockade/reasons/data.json: {where}: {first['msg']}") from exc


def emitting_files(bundle: PolicyBundle) -> dict[str, tuple[str, ...]]:
    """For each code written as a literal in a rule module (tests left out), the files giving it."""
    found: dict[str, list[str]] = {}
    for path, text in bundle.decision_modules:
        for code in dict.fromkeys(_CODE_LITERAL.findall(text)):
            found.setdefault(code, []).append(path)
    return {code: tuple(paths) for code, paths in found.items()}


def catalogued(bundle: PolicyBundle) -> list[CataloguedReason]:
    """Every catalog entry, sorted by code, with the files that give it."""
    files = emitting_files(bundle)
    return [CataloguedReason(code, entry, files.get(code, ())) for code, entry in sorted(load_reasons(bundle).items())]


def render_table(bundle: PolicyBundle) -> str:
    """The Markdown table of the catalog: code, outcome, who sets it, meaning, what to do."""
    rows = ["| code | outcome | set by | meaning | what to do |", "|---|---|---|---|---|"]
    for reason in catalogued(bundle):
        set_by = ", ".join(f"`{Path(path).name}`" for path in reason.files) or "the router"
        cells = (f"`{reason.code}`", reason.entry.outcome, set_by, reason.entry.message, reason.entry.runbook)
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def render_section(bundle: PolicyBundle) -> str:
    """The generated section, markers included."""
    return (
        f"{START}\n"
        "<!-- Generated from policies/stockade/reasons/data.json by scripts/policy-docs: edit the catalog, "
        "then run it. -->\n\n"
        f"{render_table(bundle)}"
        f"{END}"
    )


def with_section(document: str, section: str) -> str:
    """``document`` with the text between the markers (the markers included) replaced by ``section``.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    if document.count(START) != 1 or document.count(END) != 1 or document.index(START) > document.index(END):
        raise ValueError(f"the document needs one {START} line followed by one {END} line")
    before, rest = document.split(START, 1)
    _, after = rest.split(END, 1)
    return before + section + after


def regenerate(doc: Path, root: Path, *, check: bool = False) -> bool:
    """Bring the reason-code section of ``doc`` up to date with the catalog under ``root``; with
    ``check``, write nothing. Returns whether the section was stale.

    Raises:
        PolicyBundleError: the policy directory or its catalog does not load.
        ValueError: ``doc`` lacks the markers.
    """
    current = doc.read_text()
    wanted = with_section(current, render_section(load_bundle(root)))
    if wanted == current:
        return False
    if not check:
        doc.write_text(wanted)
    return True


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    """Regenerate the section (exit 0), or with ``--check`` exit 1 if it is stale; 2 on an error."""
    parser = argparse.ArgumentParser(prog="policy-docs", description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=Path("docs/policy.md"), help="the Markdown file to update")
    parser.add_argument("--dir", type=Path, default=Path("policies"), help="the policy directory")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the section is stale")
    args = parser.parse_args(argv)
    try:
        stale = regenerate(args.doc, args.dir, check=args.check)
    except (PolicyBundleError, ValueError, OSError) as exc:
        sys.stderr.write(f"policy-docs: {exc}\n")
        return 2
    if args.check and stale:
        sys.stderr.write(f"{args.doc}: the reason-code table is stale; run scripts/policy-docs\n")
        return 1
    sys.stderr.write(f"{args.doc}: {'updated' if stale else 'up to date'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
