"""Lists every skipped test, with its reason, from CTest's log and raw GoogleTest/pytest logs.

scripts/test prints this at the end of CI, so the kernel paths a machine could not run (and
why) are visible in every log: a GoogleTest skip is `GTEST_SKIP() << reason`, a pytest skip
`pytest.skip(reason)` (run with -rs). Usage: skipped_paths.py LOG [LOG ...]
"""

from __future__ import annotations

import re
import sys

_GTEST_SKIP = re.compile(r"^\[  SKIPPED \] (\S+\.\S+)")
_GTEST_REASON = re.compile(r"^\S+:\d+: Skipped$")
_PYTEST_SKIP = re.compile(r"^SKIPPED \[\d+\] (.*)$")


def skips(lines):
    """(test, reason) pairs in the order they appear."""
    found = []
    reason = None
    for i, line in enumerate(lines):
        line = line.rstrip("\n")
        if _GTEST_REASON.match(line):
            reason = lines[i + 1].strip() if i + 1 < len(lines) else ""
            continue
        m = _GTEST_SKIP.match(line)
        if m:
            if reason is not None:  # the summary at the end repeats the names without reasons
                found.append((m.group(1), reason))
                reason = None
            continue
        m = _PYTEST_SKIP.match(line)
        if m:
            where, _, why = m.group(1).partition(": ")
            found.append((where, why))
    return found


def main(paths):
    seen = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except FileNotFoundError:
            continue
        for test, reason in skips(lines):
            seen.setdefault(test, reason)
    if not seen:
        print("  none: every test ran")
    for test, reason in sorted(seen.items()):
        print(f"  {test}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
