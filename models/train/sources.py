"""Readers of the offline English text sources: Debian packages installed on this machine.

Each reader yields ``Doc``s: plain text (``text``) or a chat exchange
(``messages``, rendered later by the tokenizer's chat template). Nothing is
downloaded; a source whose package is missing raises ``SourceMissing`` naming
the package to install (``apt-get install -y PACKAGE``).

=================  =====================  ============================================
source             Debian package         what becomes a document
=================  =====================  ============================================
``pydocs``         python3.11-doc         a section of the reST sources, as prose
                                          (code blocks, tables and directives dropped)
``kerneldocs``     linux-doc-6.1          the same for the kernel's documentation, the
                                          most prose-like guides first
``fortunes``       fortunes, fortunes-min one fortune cookie (no art, no translations)
``jargon``         jargon-text            one Jargon File entry
``debref``         debian-reference-en    one section of the Debian Reference
``gcide``          dict-gcide             one dictionary entry (Webster 1913 / GCIDE)
``*_chat``         (the above)            "What is X?" / "What does X mean?" answered
                                          with the entry's first sense or paragraph
=================  =====================  ============================================

All readers are deterministic: files are read in sorted order and nothing
depends on time or hash seeds.
"""

from __future__ import annotations

import gzip
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Doc", "SourceMissing", "SOURCES", "PACKAGES"]

PYDOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
KERNEL_DOCS_DIR = Path("/usr/share/doc/linux-doc-6.1/html/_sources")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
JARGON_FILE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
DEBREF_FILE = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
GCIDE_DICT = Path("/usr/share/dictd/gcide.dict.dz")
GCIDE_INDEX = Path("/usr/share/dictd/gcide.index")

PACKAGES = ("python3.11-doc", "fortunes", "fortunes-min", "jargon-text", "debian-reference-en", "dict-gcide",
            "linux-doc-6.1")
"""Every Debian package the corpus reads (``apt-get install -y`` these first)."""


class SourceMissing(RuntimeError):
    """A source's files are not on this machine; the message names the Debian package."""


@dataclass
class Doc:
    """One training document: ``text`` (plain) or ``messages`` (a chat: [{"role", "content"}])."""

    source: str
    text: str = ""
    messages: list[dict] = field(default_factory=list)
    head: str = ""
    """The headword of a dictionary or glossary entry ("" for prose)."""

    def key(self) -> str:
        """The text that identifies the document (for the held-out split and de-duplication)."""
        return self.text if not self.messages else "\x1f".join(m["content"] for m in self.messages)


def _need(path: Path, package: str) -> None:
    if not path.exists():
        raise SourceMissing(f"{path} not found: install the Debian package {package!r} "
                            f"(apt-get install -y {package})")


def _paragraphs(text: str) -> str:
    """Join wrapped lines into one line per paragraph; paragraphs separated by a blank line."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paras if p)


# --------------------------------------------------------------------------- python docs

_PYDOCS_SKIP = ("c-api/", "distutils/", "includes/", "whatsnew/", "contents", "license", "copyright", "about", "bugs")
_RST_HEADING_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:])\1{2,}\s*$")
_RST_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_RST_ROLE = re.compile(r":[\w:.-]+:`(?:~|!)?([^`<]*?)(?:\s*<[^`>]*>)?`")
_RST_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^`>]*>)?`__?")
# Directives whose body is prose worth keeping (dedented); the rest are dropped with their body.
_PROSE_DIRECTIVES = {"note", "warning", "tip", "important", "seealso", "attention", "caution", "hint",
                     "function", "method", "class", "attribute", "data", "exception", "decorator",
                     "classmethod", "staticmethod", "describe", "opcode", "cmdoption", "envvar",
                     "versionadded", "versionchanged", "deprecated", "impl-detail", "abstractmethod",
                     "coroutinefunction", "coroutinemethod", "decoratormethod", "option"}
_SIGNATURE_DIRECTIVES = {"function", "method", "class", "attribute", "data", "exception", "decorator",
                         "classmethod", "staticmethod", "abstractmethod", "coroutinefunction",
                         "coroutinemethod", "decoratormethod"}


def _rst_inline(s: str) -> str:
    s = _RST_ROLE.sub(lambda m: m.group(1).strip(), s)
    s = _RST_LINK.sub(lambda m: m.group(1), s)
    s = s.replace("``", "").replace("**", "")
    s = re.sub(r"(?<!\w)\*(\S[^*]*?)\*(?!\w)", r"\1", s)
    s = re.sub(r"\[#[\w-]*\]_", "", s)
    s = s.replace("\\", "")
    return s


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def rst_to_prose(rst: str) -> list[tuple[str, str]]:
    """reST -> [(section title, prose)]: code blocks, tables, comments and most directives
    dropped, prose directives (notes, API descriptions) dedented, inline markup removed."""
    lines = rst.expandtabs(8).split("\n")
    sections: list[tuple[str, list[str]]] = [("", [])]
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < n else ""
        if line.strip() and _RST_HEADING_UNDERLINE.match(nxt) and len(nxt.strip()) >= len(line.strip()) - 2:
            sections.append((_rst_inline(line.strip()), []))
            i += 2
            continue
        if _RST_HEADING_UNDERLINE.match(line):  # an overline or a bare transition
            i += 1
            continue
        m = _RST_DIRECTIVE.match(line)
        if m or line.lstrip().startswith(".. "):
            base = _indent(line)
            name = m.group(2) if m else ""
            body_start = i + 1
            j = body_start
            while j < n and (not lines[j].strip() or _indent(lines[j]) > base):
                j += 1
            if name in _PROSE_DIRECTIVES:
                out = sections[-1][1]
                if name in _SIGNATURE_DIRECTIVES and m.group(3).strip():
                    out.append("")
                    out.append(_rst_inline(m.group(3).strip()))
                    out.append("")
                body = [l for l in lines[body_start:j] if not re.match(r"^\s*:[\w-]+:", l)]
                lines[body_start:j] = textwrap.dedent("\n".join(body)).split("\n") + [""] * (j - body_start - len(body))
                i = body_start
                continue
            i = j
            continue
        stripped = line.strip()
        if stripped.startswith(("+-", "+=", "|", ">>>", "...")) or re.match(r"^=+(\s+=+)+\s*$", stripped):
            i += 1
            continue
        if stripped.endswith("::"):
            # A literal (code) block follows: keep the sentence, drop the block.
            text = stripped[:-2].rstrip()
            if text:  # "Paragraph::" reads "Paragraph:"; "Paragraph. ::" reads "Paragraph."
                end = "" if text.endswith((".", ":", ";", "!", "?")) or stripped[-3:-2].isspace() else ":"
                sections[-1][1].append(_rst_inline(line.rstrip()[:-2].rstrip() + end))
            base = _indent(line)
            j = i + 1
            while j < n and (not lines[j].strip() or _indent(lines[j]) > base):
                j += 1
            sections[-1][1].append("")
            i = j
            continue
        sections[-1][1].append(_rst_inline(line))
        i += 1
    out = []
    for title, body in sections:
        prose = _paragraphs("\n".join(body))
        if len(prose) >= 200:
            out.append((title, prose))
    return out


def pydocs() -> Iterator[Doc]:
    _need(PYDOCS_DIR, "python3.11-doc")
    for path in sorted(PYDOCS_DIR.rglob("*.rst.txt")):
        rel = path.relative_to(PYDOCS_DIR).as_posix()
        if rel.startswith(_PYDOCS_SKIP):
            continue
        for title, prose in rst_to_prose(path.read_text(encoding="utf-8", errors="replace")):
            yield Doc("pydocs", f"{title}\n\n{prose}" if title else prose)


# The kernel's guides written for people come first, so a character budget keeps them.
_KERNEL_FIRST = ("process", "admin-guide", "kernel-hacking", "doc-guide", "maintainer", "dev-tools",
                 "filesystems", "mm", "core-api", "scheduler", "locking", "security", "networking")


def kerneldocs() -> Iterator[Doc]:
    _need(KERNEL_DOCS_DIR, "linux-doc-6.1")
    paths = sorted(KERNEL_DOCS_DIR.rglob("*.rst.txt"))
    rank = {d: i for i, d in enumerate(_KERNEL_FIRST)}
    paths.sort(key=lambda p: rank.get(p.relative_to(KERNEL_DOCS_DIR).parts[0], len(rank)))
    for path in paths:
        if "translations" in path.parts:
            continue
        for title, prose in rst_to_prose(path.read_text(encoding="utf-8", errors="replace")):
            yield Doc("kerneldocs", f"{title}\n\n{prose}" if title else prose)


# --------------------------------------------------------------------------- fortunes

_FORTUNE_SKIP = {"art", "ascii-art", "translate-me", "ethnic", "men-women", "drugs", "zippy"}
_OVERSTRIKE = re.compile(r".\x08")


def fortunes() -> Iterator[Doc]:
    _need(FORTUNES_DIR / "fortunes", "fortunes-min")
    for path in sorted(FORTUNES_DIR.iterdir()):
        if not path.is_file() or path.suffix or path.is_symlink() or path.name in _FORTUNE_SKIP:
            continue
        text = _OVERSTRIKE.sub("", path.read_text(encoding="utf-8", errors="replace"))
        for cookie in re.split(r"\n%\n", text):
            cookie = "\n".join(l.rstrip() for l in cookie.strip("\n%").split("\n")).strip()
            if 20 <= len(cookie) <= 4000:
                yield Doc("fortunes", textwrap.dedent(cookie))


# --------------------------------------------------------------------------- jargon file

_JARGON_ENTRY = re.compile(r"^   :([^:\n]+):\s*(.*)$", re.M)
_JARGON_XREF = re.compile(r"\{([^{}]+)\}")


def _jargon_entries() -> Iterator[tuple[str, str, str]]:
    _need(JARGON_FILE, "jargon-text")
    text = gzip.open(JARGON_FILE, "rt", encoding="utf-8", errors="replace").read()
    heads = list(_JARGON_ENTRY.finditer(text))
    for a, b in zip(heads, heads[1:] + [None]):
        body = text[a.end(): b.start() if b else len(text)]
        body = _JARGON_XREF.sub(r"\1", body)
        body = _paragraphs(textwrap.dedent(body))
        if len(body) >= 40:
            yield a.group(1).strip(), a.group(2).strip(), body


def jargon() -> Iterator[Doc]:
    for term, pos, body in _jargon_entries():
        head = f"{term}" + (f" ({pos.rstrip('.').strip()})" if pos else "")
        yield Doc("jargon", f"{head}\n\n{body}")


def jargon_chat() -> Iterator[Doc]:
    for term, _pos, body in _jargon_entries():
        first = re.sub(r"^\[[^\]]*\]\s*", "", body.split("\n\n")[0])
        first = re.sub(r"^1\.\s*", "", first)
        if 40 <= len(first) <= 1200:
            yield Doc("jargon_chat", messages=[{"role": "user", "content": f"What is {term} in hacker slang?"},
                                               {"role": "assistant", "content": first}])


# --------------------------------------------------------------------------- debian reference

def debref() -> Iterator[Doc]:
    _need(DEBREF_FILE, "debian-reference-en")
    text = gzip.open(DEBREF_FILE, "rt", encoding="utf-8", errors="replace").read()
    for part in re.split(r"\n(?=\d+(?:\.\d+)+\.\s+\S)", text):
        lines = part.strip("\n").split("\n")
        title, body = lines[0].strip(), "\n".join(lines[1:])
        # Tables and command listings are indented further and full of symbols: keep prose paragraphs.
        paras = [p for p in _paragraphs(textwrap.dedent(body)).split("\n\n")
                 if len(p) > 60 and sum(c.isalpha() or c == " " for c in p) > 0.85 * len(p)]
        if paras:
            yield Doc("debref", title + "\n\n" + "\n\n".join(paras))


# --------------------------------------------------------------------------- GCIDE dictionary

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_GCIDE_POS = re.compile(r"((?:(?:n|a|v|t|i|adv|adj|prep|conj|interj|pron|pl|p|imp|pr|sing|pret|superl|compar)\.\s*,?\s*)+)")
_GCIDE_HEAD = re.compile(r"^(\S[^\\\n]*?)\s*\\[^\\]*\\,?\s*(.*)$")


def _b64int(s: str) -> int:
    v = 0
    for c in s:
        v = v * 64 + _B64.index(c)
    return v


def _gcide_entries() -> Iterator[tuple[str, str, list[str]]]:
    """(headword, part of speech, senses) of every GCIDE entry, in index order."""
    _need(GCIDE_DICT, "dict-gcide")
    data = gzip.open(GCIDE_DICT, "rb").read()
    seen: set[tuple[int, int]] = set()
    for line in GCIDE_INDEX.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or parts[0].startswith("00-database"):
            continue
        span = (_b64int(parts[1]), _b64int(parts[2]))
        if span in seen:
            continue
        seen.add(span)
        raw = data[span[0]: span[0] + span[1]].decode("utf-8", errors="replace")
        for entry in re.split(r"\n(?=\S)", raw):
            head = _GCIDE_HEAD.match(entry.split("\n")[0])
            if not head:
                continue
            word = head.group(1).strip()
            # Etymologies ([F. abus, L. abusus ...]) and source tags span lines: drop them first.
            rest = re.sub(r"\[[^\[\]]*\]", "", head.group(2) + entry[len(entry.split("\n")[0]):])
            pos_m = _GCIDE_POS.match(rest.strip())
            pos = pos_m.group(1).strip().rstrip(";,") if pos_m else ""
            rest = rest.strip()[pos_m.end():] if pos_m else rest
            senses = []
            for block in re.split(r"\n\s*\n", rest):
                if not block.strip() or re.match(r"^\s{8,}", block):  # quotations are indented deeper
                    continue
                s = " ".join(block.split())
                s = re.sub(r"\{([^{}]*)\}", r"\1", s).strip(" ,;")
                if s.startswith(("Syn:", "Usage:", "Note:")) or len(s) < 15:
                    continue
                senses.append(s)
            if senses and word.isascii():
                yield word, pos, senses


def gcide() -> Iterator[Doc]:
    for word, pos, senses in _gcide_entries():
        yield Doc("gcide", f"{word}" + (f", {pos}" if pos else "") + "\n\n" + "\n".join(senses), head=word.lower())


def gcide_chat() -> Iterator[Doc]:
    for word, pos, senses in _gcide_entries():
        first = re.sub(r"^1\.\s*", "", senses[0])
        if 25 <= len(first) <= 600 and word.isalpha():
            kind = f" ({pos})" if pos else ""
            w = word.lower()
            yield Doc("gcide_chat", messages=[{"role": "user", "content": f"What does the word \"{w}\" mean?"},
                                              {"role": "assistant", "content": f"{w.capitalize()}{kind}: {first}"}],
                      head=w)


SOURCES = {
    "pydocs": pydocs,
    "kerneldocs": kerneldocs,
    "fortunes": fortunes,
    "jargon": jargon,
    "jargon_chat": jargon_chat,
    "debref": debref,
    "gcide": gcide,
    "gcide_chat": gcide_chat,
}
"""name -> reader; `models.train.corpus` takes a character budget of each."""

