"""Readers for the deployment files, for tests/test_docker.py: a Dockerfile parser (the subset
of the syntax this repository uses), docker-compose value helpers, and an os.environ stand-in
that records what was looked up."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30


# ---- Dockerfile parsing (the subset of the syntax this repository uses)


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comment lines dropped (also inside a
    continuation, as Docker does)."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (not parts and not line):
            continue
        if not parts:
            start = number
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        parts.append(line)
        keyword, _, args = " ".join(p for p in parts if p).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    assert not parts, "the Dockerfile ends inside a line continuation"
    return out


_VAR = re.compile(r"\$(?:\{(\w+)(?::?-([^}]*))?\}|(\w+))")


def expand(text: str, variables: dict[str, str]) -> str:
    """$VAR, ${VAR} and ${VAR:-default} with the given values (else the default, else '')."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        return variables.get(name) or m.group(2) or ""

    return _VAR.sub(sub, text)


def split_flags(args: str) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    words = shlex.split(args)
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


@dataclass
class Dockerfile:
    instructions: list[Instruction]

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def stage(self) -> list[Instruction]:
        """The instructions of the final build stage (after its FROM)."""
        froms = [n for n, i in enumerate(self.instructions) if i.keyword == "FROM"]
        assert froms, "no FROM"
        return self.instructions[froms[-1] :]

    def global_args(self) -> dict[str, str]:
        """ARG defaults declared before the first FROM (the ones FROM may use)."""
        args: dict[str, str] = {}
        for i in self.instructions:
            if i.keyword == "FROM":
                break
            if i.keyword == "ARG":
                name, _, default = i.args.partition("=")
                args[name.strip()] = default.strip().strip('"')
        return args

    def base_image(self) -> str:
        return expand(self.stage()[0].args.split()[0], self.global_args())

    def env(self) -> dict[str, str]:
        """ENV of the final stage, values expanded as Docker does, in order."""
        env: dict[str, str] = {}
        for i in self.stage():
            if i.keyword != "ENV":
                continue
            words = shlex.split(i.args)
            if words and "=" not in words[0]:  # legacy form: ENV KEY value with spaces
                env[words[0]] = expand(" ".join(words[1:]), env)
                continue
            for word in words:
                key, _, value = word.partition("=")
                env[key] = expand(value, env)
        return env

    def workdir_at(self, target: Instruction) -> str:
        workdir = "/"
        for i in self.stage():
            if i is target:
                break
            if i.keyword == "WORKDIR":
                workdir = str(Path(workdir) / i.args)
        return workdir

    def copies(self) -> Iterator[tuple[list[str], str]]:
        """(sources relative to the build context, absolute destination) of each COPY/ADD
        from the context (not from another stage)."""
        for i in self.stage():
            if i.keyword not in ("COPY", "ADD"):
                continue
            flags, words = split_flags(i.args)
            if "from" in flags:
                continue
            assert len(words) >= 2, f"line {i.line}: {i.keyword} needs a source and a dest"
            dest = words[-1]
            if not dest.startswith("/"):
                dest = str(Path(self.workdir_at(i)) / dest)
            yield words[:-1], dest.rstrip("/") or "/"

    def command(self) -> list[str]:
        """ENTRYPOINT + CMD of the final stage, both required in exec (JSON) form so that
        signals reach tritonserver."""
        argv: list[str] = []
        for keyword in ("ENTRYPOINT", "CMD"):
            found = [i for i in self.stage() if i.keyword == keyword]
            if not found:
                continue
            value = json.loads(found[-1].args)
            assert isinstance(value, list), f"{keyword} must use the exec (JSON) form"
            argv += value
        return argv

    def runs(self) -> list[str]:
        return [i.args for i in self.stage() if i.keyword == "RUN"]

    def healthcheck(self) -> str:
        (check,) = self.of("HEALTHCHECK")
        _, _, command = check.args.partition("CMD")
        return command.strip()


# ---- Compose helpers


def compose_default(value: Any) -> str:
    """A compose value with ${VAR:-default} interpolated to its default (the host
    environment is deliberately ignored: the file must work without one)."""
    return expand(str(value), {}).replace("$$", "$")


def parse_bytes(value: Any) -> int:
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", str(value).strip().lower())
    assert m, f"not a byte size: {value!r}"
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": GIB}[m.group(2)])


def parse_duration(value: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def port_pairs(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port."""
    pairs: dict[int, int] = {}
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            pairs[int(entry["target"])] = int(entry.get("published", entry["target"]))
            continue
        fields = compose_default(entry).split("/")[0].split(":")
        assert len(fields) >= 2, f"port {entry!r} is not published on the host"
        pairs[int(fields[-1])] = int(fields[-2])
    return pairs


def url_port(text: str) -> tuple[int, str]:
    m = re.search(r"https?://(?:localhost|127\.0\.0\.1):(\d+)(/[\w/.-]*)", text)
    assert m, f"no local URL in {text!r}"
    return int(m.group(1)), m.group(2)


def flag_values(argv: list[str], flag: str) -> list[str]:
    values = []
    for n, word in enumerate(argv):
        if word.startswith(flag + "="):
            values.append(word.split("=", 1)[1])
        elif word == flag and n + 1 < len(argv):
            values.append(argv[n + 1])
    return values


class RecordingEnviron(dict[str, str]):
    """An os.environ stand-in that remembers which variables were looked up."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.looked_up: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(str(key))
        return super().__contains__(key)
