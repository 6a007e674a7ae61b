"""Compatibility of a prefill / decode pair.

Two workers may exchange pages only if they agree on what a page *means*:
model identity, layer count, page size, cache byte formats and whether the
MTP layer exists (its pages travel too). `CompatInfo` holds those fields; its
`digest` is the compatibility hash carried in the handshake. On a hash
mismatch the fields are diffed one by one so the error names what differs.
The controller checks the same fields before placement; this is the runtime
re-check against a peer that was deployed from a different config.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any

from transfer.errors import CompatibilityError, FieldDiff
from transfer.regions import RegionTable

WIRE_VERSION = 1
"""Version of the handshake and notification formats of this module set."""


@dataclass(frozen=True)
class CompatInfo:
    """What both sides of a transfer must agree on.

    ``model``: model identity (e.g. checkpoint name + revision or config hash).
    ``num_layers``: attention layers with caches, MTP layer(s) included.
    ``page_size``: tokens per page. ``kv_format`` / ``index_format``: byte
    format names of the MLA and indexer caches (e.g. ``"fp8_656"``).
    ``has_mtp``: the MTP layer exists. ``state_formats``: ``(kind, format)``
    of every state-page cache (V4's SWA / compressed), empty for V3.2 / GLM-5.
    """

    model: str
    num_layers: int
    page_size: int
    kv_format: str
    index_format: str
    has_mtp: bool
    state_formats: tuple[tuple[str, str], ...] = ()
    wire_version: int = WIRE_VERSION

    def to_wire(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["state_formats"] = [list(p) for p in sorted(self.state_formats)]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "CompatInfo":
        return cls(
            model=str(d["model"]),
            num_layers=int(d["num_layers"]),
            page_size=int(d["page_size"]),
            kv_format=str(d["kv_format"]),
            index_format=str(d["index_format"]),
            has_mtp=bool(d["has_mtp"]),
            state_formats=tuple((str(k), str(v)) for k, v in d.get("state_formats", [])),
            wire_version=int(d.get("wire_version", 0)),
        )

    def digest(self) -> str:
        """Compatibility hash: sha256 of the canonical JSON of every field (hex)."""
        blob = json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def diff_compat(local: CompatInfo, remote: CompatInfo) -> list[FieldDiff]:
    """Every field on which ``local`` and ``remote`` differ, in declaration order."""
    lw, rw = local.to_wire(), remote.to_wire()
    return [FieldDiff(f.name, lw[f.name], rw[f.name]) for f in fields(CompatInfo) if lw[f.name] != rw[f.name]]


def diff_regions(local: RegionTable, remote: RegionTable) -> list[FieldDiff]:
    """Differences in page geometry: a region missing on one side, or a different ``bytes_per_page``.

    Page counts and addresses may differ (pools are sized per replica).
    """
    out: list[FieldDiff] = []
    lk = {e.key: e for e in local}
    rk = {e.key: e for e in remote}
    for key in sorted(set(lk) | set(rk)):
        name = f"regions[layer={key[0]},kind={key[1]}]"
        if key not in rk:
            out.append(FieldDiff(name, "present", "missing"))
        elif key not in lk:
            out.append(FieldDiff(name, "missing", "present"))
        elif lk[key].bytes_per_page != rk[key].bytes_per_page:
            out.append(FieldDiff(f"{name}.bytes_per_page", lk[key].bytes_per_page, rk[key].bytes_per_page))
    return out


def check_compatible(
    peer: str,
    local: CompatInfo,
    remote: CompatInfo,
    remote_hash: str,
    local_regions: RegionTable,
    remote_regions: RegionTable,
) -> None:
    """Raise `CompatibilityError` naming every differing field, else return.

    ``remote_hash`` is the hash the peer computed itself: a peer whose fields
    match but whose hash differs runs a different hash definition, reported as
    field ``compat_hash``.
    """
    diffs = diff_compat(local, remote)
    if not diffs and remote_hash != local.digest():
        diffs = [FieldDiff("compat_hash", local.digest(), remote_hash)]
    diffs += diff_regions(local_regions, remote_regions)
    if diffs:
        raise CompatibilityError(peer, diffs)
