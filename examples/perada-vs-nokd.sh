#!/usr/bin/env bash
# docs/RESULTS.md: PerAda with and without server distillation on the offline default, seeds 0-2.
# Each seed fixes the partition, so both methods see the same clients. Needs `make demo` (or its pretrain) first.
set -euo pipefail
out=${1:-runs/results}
for seed in 0 1 2; do
  for method in perada perada-nokd; do
    run="$out/$method-seed$seed"
    [ -f "$run/report.json" ] || { rm -rf "$run"; peradapt train --config examples/fmnist-demo.yaml \
      --method "$method" --seed "$seed" --out "$run"; }
  done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
rows = {}
for report in sorted(pathlib.Path(sys.argv[1]).glob("*/report.json")):
    s = json.loads(report.read_text())["summary"]
    rows.setdefault(report.parent.name.rsplit("-seed", 1)[0], []).append(s)
keys = ["personalized_local_test", "personalized_global_test", "global_local_test", "global_global_test"]
print("| method | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for method, summaries in rows.items():
    cells = []
    for key in keys:
        values = [100 * s[key] for s in summaries]
        cells.append(f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}")
    print(f"| {method} ({len(summaries)} seeds) | " + " | ".join(cells) + " |")
PY
