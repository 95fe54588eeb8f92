#!/usr/bin/env bash
# docs/RESULTS.md: PerAda as Algorithm 1 prints it against PerAda with the authors' code's rules, seeds 0-2, on the
# Table-1-style offline setting (examples/fmnist-compare.yaml). Each seed fixes the partition: both variants see
# the same clients. Needs `make demo` (or its pretrain) first.
set -euo pipefail
out=${1:-runs/authors}
authors=(--lam 2 --frozen-bn train --kd-mode train --kd-augment crop-flip --kd-normalization own
  --kd-eval-every 1 --kd-rounds 2)
for seed in 0 1 2; do
  for variant in algorithm1 authors; do
    run="$out/$variant-seed$seed"
    extra=()
    [ "$variant" = authors ] && extra=("${authors[@]}")
    [ -f "$run/report.json" ] || { rm -rf "$run"; peradapt train --config examples/fmnist-compare.yaml \
      --seed "$seed" --eval-every 2 "${extra[@]}" --out "$run"; }
  done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
rows = {}
for report in sorted(pathlib.Path(sys.argv[1]).glob("*/report.json")):
    r = json.loads(report.read_text())
    selected = r["selected_on_test"]
    values = {**r["summary"], "selected_personalized_local_test": selected["personalized_local_test"]["mean"],
              "selected_global_global_test": selected["global_global_test"]["value"]}
    rows.setdefault(report.parent.name.rsplit("-seed", 1)[0], []).append(values)
keys = ["personalized_local_test", "personalized_global_test", "global_local_test", "global_global_test",
        "selected_personalized_local_test", "selected_global_global_test"]
print("| variant | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for variant, runs in rows.items():
    cells = []
    for key in keys:
        values = [100 * run[key] for run in runs]
        cells.append(f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}")
    print(f"| {variant} ({len(runs)} seeds) | " + " | ".join(cells) + " |")
PY
