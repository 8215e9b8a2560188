"""What ``corpus.py advise`` left in its folder, as one JSON: per entry, the plans advise ranked,
left out and could not run (why), or the last line of its log where it wrote no advice.

    python3 benchmarks/advise_sweep_summary.py DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    rows = []
    for log in sorted(folder.glob("*.log")):
        name, advice = log.stem, folder / f"{log.stem}.json"
        if advice.is_file():
            a = json.loads(advice.read_text())
            rows.append({"name": name, "best": a.get("best"), "plans": len(a.get("plans", [])),
                         "skipped": len(a.get("skipped", {})), "failed": a.get("failed", {})})
        else:
            lines = log.read_text().strip().splitlines()
            rows.append({"name": name, "error": lines[-1] if lines else "no output (stopped before it ended)"})
    stopped = [r["name"] for r in rows if "error" in r]
    failing = {r["name"]: len(r["failed"]) for r in rows if r.get("failed")}
    summary = {"entries": len(rows), "advised": len(rows) - len(stopped), "stopped": stopped,
               "with_failed_plans": failing}
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
