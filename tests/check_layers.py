#!/usr/bin/env python3
"""The layers of docs/architecture.md, checked on every quoted #include of the tree.

Each folder may include the project headers of the folders its rule lists and nothing else
of the project (system and third-party headers, in angle brackets, are not checked). A
quoted include must name an existing file, by its path from the repository root
("src/core/validate.hpp") or, for the public headers, from include/ ("flashattn/plan.hpp").
Exit status 1 lists every violation; 0 prints how many includes were checked.
"""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])

# folder -> the folders (or single headers) its files may include. The longest matching
# folder decides; "flashattn" is the public API (include/flashattn).
RULES: dict[str, tuple[str, ...]] = {
    "include/flashattn": ("flashattn",),
    "src/core": ("flashattn", "src/core"),
    "src/model": ("flashattn", "src/core", "src/model"),
    "src/cpu": ("flashattn", "src/core", "src/cpu", "src/api/backend.hpp"),
    "src/cuda": ("flashattn", "src/core", "src/cuda", "src/api/backend.hpp"),
    "src/api": ("flashattn", "src/core", "src/api"),
    "src/dist": ("flashattn", "src/core", "src/dist", "src/api/float32_out.hpp"),
    "src/python": ("flashattn",),
    "tools/support": ("flashattn", "tools/support"),
    "tools/baseline": ("flashattn", "src/core", "tools/baseline"),
    "tools/cli": ("flashattn", "tools/cli", "tools/support", "tools/baseline"),
    "examples": ("flashattn",),
}
SOURCES = (".cpp", ".hpp", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def rule_of(path: str) -> tuple[str, ...] | None:
    matches = [folder for folder in RULES if path == folder or path.startswith(folder + "/")]
    return RULES[max(matches, key=len)] if matches else None


def allowed(target: str, rule: tuple[str, ...]) -> bool:
    return any(target == entry or target.startswith(entry + "/") for entry in rule)


def resolve(include: str, source: pathlib.Path) -> str | None:
    """The include's path from the root, or None when it names no file."""
    for base in (ROOT, ROOT / "include", source.parent):
        candidate = (base / include).resolve()
        if candidate.is_file():
            rel = candidate.relative_to(ROOT).as_posix()
            return rel.removeprefix("include/") if rel.startswith("include/flashattn/") else rel
    return None


def main() -> int:
    violations, checked = [], 0
    for source in sorted(ROOT.rglob("*")):
        rel = source.relative_to(ROOT).as_posix()
        if source.suffix not in SOURCES or rel.startswith(("build", ".")) or "/build" in rel:
            continue
        rule = rule_of(rel)
        if rule is None:
            continue  # tests, fuzzers and benchmarks may include any layer
        for include in INCLUDE.findall(source.read_text(errors="replace")):
            checked += 1
            target = resolve(include, source)
            if target is None:
                violations.append(f"{rel}: #include \"{include}\" names no file of the tree")
            elif not allowed(target, rule):
                violations.append(f"{rel}: #include \"{include}\" ({target}) is outside its layer {rule}")
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} include(s) break the layers of docs/architecture.md")
        return 1
    print(f"{checked} includes checked against docs/architecture.md's layers: none crosses one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
