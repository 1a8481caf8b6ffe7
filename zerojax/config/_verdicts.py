"""What the DeepSpeed reader did with each key of a file: honoured, ignored or refused, and why.

The reader records one verdict per key it meets; ``deepspeed_fields`` turns the refusals into
one ConfigError and the warned keys into one IgnoredKeysWarning, and ``zerojax config check``
prints them all::

    v = Verdicts()
    v.honour("zero_optimization.stage", "-> ZeroConfig.stage = 2")
    v.warn("dump_state", "dump_state=True: not one of zerojax's monitors")
    v.refuse("zero_optimization.stagee", 'Unknown key ... Did you mean "stage"?')
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from zerojax._errors import ConfigError

__all__ = ["HONOURED", "IGNORED", "REFUSED", "Verdict", "Verdicts", "WARNED", "join_problems"]

HONOURED = "honoured"  # zerojax does what the key says
IGNORED = "ignored"  # not read, and it makes no difference (a comment, an unused "auto")
WARNED = "warned-ignored"  # not honoured and it would make a difference: IgnoredKeysWarning
REFUSED = "refused"  # ConfigError
_RANK = {HONOURED: 0, IGNORED: 1, WARNED: 2, REFUSED: 3}


@dataclasses.dataclass(frozen=True)
class Verdict:
    path: str  # the key's path in the file, e.g. "zero_optimization.offload_optimizer.device"
    kind: str  # HONOURED | IGNORED | WARNED | REFUSED
    why: str


class Verdicts:
    """The verdicts of one read, in the order they were given."""

    def __init__(self):
        self.rows: list[Verdict] = []
        self.deprecated: list[str] = []  # messages for DeprecatedKeyWarning, one per deprecated key
        self.aliases: dict[str, str] = {}  # a key written from a deprecated one -> the deprecated key

    def _add(self, path: str, kind: str, why: str) -> None:
        for new, old in self.aliases.items():
            if path == new or path.startswith(new + "."):
                path = old
                break
        self.rows.append(Verdict(path, kind, why))

    def honour(self, path: str, why: str) -> None:
        self._add(path, HONOURED, why)

    def ignore(self, path: str, why: str) -> None:
        self._add(path, IGNORED, why)

    def warn(self, path: str, why: str) -> None:
        self._add(path, WARNED, why)

    def refuse(self, path: str, why: str) -> None:
        self._add(path, REFUSED, why)

    def of(self, kind: str) -> list[Verdict]:
        return [r for r in self.rows if r.kind == kind]

    @property
    def refused(self) -> list[Verdict]:
        return self.of(REFUSED)

    @property
    def warned(self) -> list[Verdict]:
        return self.of(WARNED)

    def refused_under(self, path: str) -> bool:
        """Whether anything at ``path`` or below it was refused."""
        return any(r.path == path or r.path.startswith(path + ".") for r in self.refused)

    def for_key(self, path: str) -> list[Verdict]:
        """The verdicts that decide ``path``: the most severe among its own and its ancestors'
        (an ignored block ignores its keys), from the deepest level that has that kind."""
        levels, probe = [], path
        while True:
            rows = [r for r in self.rows if r.path == probe]
            if rows:
                levels.append(rows)
            if "." not in probe:
                break
            probe = probe.rpartition(".")[0]
        if not levels:
            return []
        worst = max(_RANK[r.kind] for rows in levels for r in rows)
        for rows in levels:
            chosen = [r for r in rows if _RANK[r.kind] == worst]
            if chosen:
                return chosen
        return []

    def raise_refused(self) -> None:
        """ConfigError listing every refusal, if there is one."""
        if self.refused:
            raise ConfigError(join_problems([r.why for r in self.refused]))

    def __iter__(self) -> Iterator[Verdict]:
        return iter(self.rows)


def join_problems(messages: list) -> str:
    """One message for several problems (the message itself when there is one)."""
    if len(messages) == 1:
        return messages[0]
    return f"The DeepSpeed config has {len(messages)} problems:\n  - " + "\n  - ".join(messages)
