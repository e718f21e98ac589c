"""Says which service-backed test groups ran and which skipped, and why, from the JSON reports of tests/services.py in
FOLDER; exits 1 where a service this machine has (named after FOLDER) had tests skipped.

Usage: python3 .ci/services.py FOLDER [SERVICE ...]"""

import json
import sys
from pathlib import Path

SERVICES = ("redis", "postgresql", "chromium", "shared-data")


def merged(folder: Path) -> dict[str, dict]:
    groups: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")):
        for service, group in json.loads(path.read_text()).items():
            into = groups.setdefault(service, {"ran": 0, "skipped": 0, "reasons": set()})
            into["ran"] += group["ran"]
            into["skipped"] += group["skipped"]
            into["reasons"].update(group["reasons"])
    return groups


def main(folder: str, *have: str) -> int:
    groups, bad = merged(Path(folder)), []
    for service in SERVICES:
        group = groups.get(service)
        if group is None:
            print(f"{service}: no report names it (did a pytest step fail before its end?)")
            bad += [service] if service in have else []
            continue
        why = f": {'; '.join(sorted(group['reasons']))}" if group["reasons"] else ""
        print(f"{service}: {group['ran']} ran, {group['skipped']} skipped{why}")
        if group["skipped"] and service in have:
            bad.append(service)
    if bad:
        print(f"failed: this machine has {', '.join(bad)}, yet tests that need it skipped (see why above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
