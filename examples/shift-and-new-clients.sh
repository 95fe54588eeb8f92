#!/usr/bin/env bash
# docs/RESULTS.md "Distribution shift and new clients": PerAda, PerAda w/o KD and the baselines on the offline
# default with 4 of the 20 clients held out of training; then every run is evaluated on fmnist-c and
# personalizes each held-out client from its global model. Needs `make demo` (or its pretrain) first.
# Every step is skipped when its result exists, so an interrupted script just runs again.
set -euo pipefail
out=${1:-runs/compare-holdout}
methods=${METHODS:-perada perada-nokd fedavg-ft ditto apfl fedprox}
seeds=${SEEDS:-2}
python -m peradapt compare --methods "${methods// /,}" --seeds "$seeds" --config examples/fmnist-compare.yaml \
  --holdout-clients 4 --no-anchors --out "$out"
runs=()
for method in $methods; do
  for ((seed = 0; seed < seeds; seed++)); do
    run="$out/$method-seed$seed"
    runs+=("$run")
    [ -f "$run/ood-fmnist-c.json" ] || python -m peradapt eval --run "$run" --ood fmnist-c --ood-limit 300
    for client in 16 17 18 19; do
      [ -f "$run/new_clients/$client/result.json" ] || python -m peradapt personalize --run "$run" --new-client "$client"
    done
  done
done
python -m peradapt report "${runs[@]}" --out "$out/report"
