"""Print the node ids of the tests a pytest JUnit XML report says skipped because a module could not be imported
(pytest.importorskip's reason), one per line: .ci/run runs them again once every extra is installed. A module-level
importorskip skips the whole file at collection: JUnit names that file as the test (classname empty, name its dotted
path) and puts the reason in the text, not the message ("collection skipped")."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def node_id(classname: str, name: str) -> str:
    """tests.test_x[.Class] + test_y[param] -> tests/test_x.py[::Class]::test_y[param]; "" + tests.test_x: the file."""
    if not classname:
        return str(Path(*name.split(".")).with_suffix(".py"))
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        path = Path(*parts[:k]).with_suffix(".py")
        if path.exists():
            return "::".join([str(path), *parts[k:], name])
    raise SystemExit(f"no test file for {classname}")


def main(report: str) -> None:
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None and "could not import" in (skipped.get("message") or "") + (skipped.text or ""):
            print(node_id(case.get("classname", ""), case.get("name", "")))


if __name__ == "__main__":
    main(sys.argv[1])
