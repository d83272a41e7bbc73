#!/usr/bin/env bash
# The main job: a local 2-worker cluster trains an MLP on Fashion-MNIST with a
# compressor (default: top-1% with error feedback), then with the stock
# MultiWorkerMirroredStrategy, and prints accuracy and bytes per step side by side.
#
#   bash scripts/demo.sh                      # defaults
#   COMPRESSOR="qsgd:levels=7" EPOCHS=3 bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
COMPRESSOR=${COMPRESSOR:-ef+topk:ratio=0.01}
EPOCHS=${EPOCHS:-2}
MODEL=${MODEL:-mlp}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--workers=2 --dataset=fashion_mnist --model="$MODEL" --epochs="$EPOCHS" --timeout=1800)

echo "== tfgc: $COMPRESSOR, 2 workers, $MODEL on Fashion-MNIST =="
"$PYTHON" -m tfgc.train "${common[@]}" --compressor="$COMPRESSOR" --json_out="$out/tfgc.json"
echo "== stock MultiWorkerMirroredStrategy, same model and data =="
"$PYTHON" -m tfgc.train "${common[@]}" --baseline --json_out="$out/baseline.json"

"$PYTHON" - "$out/tfgc.json" "$out/baseline.json" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]
print()
print("bytes per worker and step; 'sent' is what crosses a worker's link")
print(f"{'run':<28} {'test acc':>8} {'payload':>10} {'sent':>10} {'wire ratio':>10} {'step ms':>8}")
for r in runs:
    name = "stock MWMS" if r["baseline"] else r["compressor"]
    print(f"{name:<28} {r['test_accuracy']:>8.4f} {r['payload_bytes_per_step']:>10,} "
          f"{r['sent_bytes_per_step']:>10,} {r['wire_ratio']:>9.1f}x {r['step_time_ms']:>8.2f}")
PY
