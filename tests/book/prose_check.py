"""Find numbers typed by hand in a chapter's prose.

The book's promise: a number in the text comes from code that just ran. So a markdown cell may
state a *result* only through glue (``{glue:text}`name:.3g```); a decimal number, a number in
scientific notation or a percentage that appears in prose must be a *defined input* (an input the
text chooses, such as x = (3, 4) or ε = 1e-6) named in ``prose_allowlist.yml``, reviewed there
with the reason it is not a result.

What is read: every markdown cell of every chapter in ``_toc.yml``, including inline math and
inline code (a typed result hides there too). What is skipped: glue roles (their values come from
code), fenced code blocks that are not directives (code shown, not claimed), directive option
lines (``:label:``), link targets and cross-reference roles. Plain integers are not flagged: they
count things (48 blocks, 2 rows) far more often than they report measurements, and glue covers
the measured ones.
"""

from __future__ import annotations

import re

# A decimal (0.8485), scientific notation (1e-6, 2.5E+3) or a percentage (1%, 12.5 %, 8 percent).
NUMBER = re.compile(
    r"(?<![\w.])("
    r"\d+(?:\.\d+)?[eE][-+]?\d+"  # scientific
    r"|\d+(?:\.\d+)?\s?(?:\\?%|percent)"  # percentage
    r"|\d+\.\d+"  # decimal
    r")(?![\w])"
)
_ROLE = re.compile(
    r"\{(?:glue|glue:text|glue:any|glue:md|doc|ref|numref|cite|cite:p|cite:t|eq|"
    r"download|term)\}`[^`]*`"
)
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_FENCE = re.compile(r"^(```+|:::+)(.*)$")


def prose(markdown: str) -> str:
    """The text of a markdown cell that states things: code blocks and roles removed."""
    out, fence = [], None
    for line in markdown.splitlines():
        m = _FENCE.match(line.strip())
        if fence is None and m:
            is_directive = m.group(2).strip().startswith("{")
            fence = (m.group(1), is_directive)
            continue
        if fence is not None and line.strip() == fence[0]:
            fence = None
            continue
        if fence is not None and not fence[1]:
            continue  # code block content
        if line.strip().startswith(":") and re.match(r"^\s*:[\w-]+:", line):
            continue  # directive option (:label:, :class:)
        out.append(line)
    text = "\n".join(out)
    text = _ROLE.sub(" ", text)
    return _LINK_TARGET.sub("]", text)


def typed_numbers(markdown: str) -> list[str]:
    """Every decimal, scientific or percentage number in the prose of ``markdown``."""
    return [
        m.group(1).replace(" ", "").replace("\\%", "%")
        for m in NUMBER.finditer(prose(markdown))
    ]
