"""Write tests/file_durations.json from a JUnit XML report of a full run: seconds per test file.

    python -m pytest ... -n 2 --dist loadfile --junitxml=/tmp/run.xml tests
    python tools/update_test_durations.py /tmp/run.xml

tests/conftest.py hands the files to pytest-xdist's workers longest first from these figures
(longest-processing-time-first: the workers' last files are short ones, so they finish
together instead of one running a long file alone at the end). Stale figures only change the
order, never what runs.
"""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                   "file_durations.json")


def file_seconds(report: str) -> dict[str, float]:
    """tests/<path>.py -> the summed time of its test cases in the report (setup, call and
    teardown: JUnit's figure per case)."""
    totals: dict[str, float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is dotted: tests.model.test_x[.TestClass]; the file is the first part that
        # starts with test_
        parts = []
        for part in module:
            parts.append(part)
            if part.startswith("test_"):
                break
        path = "/".join(parts) + ".py"
        totals[path] = totals.get(path, 0.0) + float(case.get("time", 0.0))
    return totals


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    totals = file_seconds(sys.argv[1])
    ordered = dict(sorted(((k, round(v, 1)) for k, v in totals.items()),
                          key=lambda kv: (-kv[1], kv[0])))
    with open(OUT, "w") as handle:
        json.dump(ordered, handle, indent=0)
        handle.write("\n")
    print(f"{len(ordered)} files, {sum(ordered.values()) / 60:.1f} min in all -> {OUT}")


if __name__ == "__main__":
    main()
