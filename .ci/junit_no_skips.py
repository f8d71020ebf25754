"""Fail unless a pytest JUnit XML file ran at least one test and skipped none (the Metal job:
a runner without a Metal device must not pass by skipping everything).

    python .ci/junit_no_skips.py FILE.xml
"""

import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    cases = list(ET.parse(path).getroot().iter("testcase"))
    skipped = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("skipped") is not None]
    print(f"{path}: {len(cases)} tests, {len(skipped)} skipped")
    for s in skipped:
        print(f"  skipped: {s}")
    return 0 if cases and not skipped else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
