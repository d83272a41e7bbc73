#!/usr/bin/env bash
# The main job: tfgc against the stock MultiWorkerMirroredStrategy, side by side, on the
# figure users choose by: time to reach the accuracy dense training reaches.
#
# As root, with network namespaces and tc (the usual case on these machines): a local
# cluster of 2 workers, each behind a link shaped to LINK_RATE (default 100mbit), trains
# the MLP on Fashion-MNIST with the stock strategy and with COMPRESSOR at its
# recommended setting (tfgc.compressors.recommended) until the test accuracy reaches the
# target (the stock strategy's final accuracy on a fast link, minus half a point), and
# prints the time each took (benchmarks/time_to_accuracy.py does the work). Otherwise
# the same two runs go over loopback, where the link is not what limits a step, and the
# demo says why in one line. Tables, plots and JSON go to build/demo/ (DEMO_DIR).
#
#   bash scripts/demo.sh                                   # defaults
#   LINK_RATE=1gbit COMPRESSOR=dgc EPOCHS=3 bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
PYTHON=$TFGC_PY
COMPRESSOR=${COMPRESSOR:-qsgd}
LINK_RATE=${LINK_RATE:-100mbit}
EPOCHS=${EPOCHS:-3}
MODEL=${MODEL:-mlp}
BUDGET=${BUDGET:-240}
out=${DEMO_DIR:-build/demo}
mkdir -p "$out"
out=$(cd "$out" && pwd)

if why=$("$PYTHON" benchmarks/netns.py); then
  echo "== tfgc ($COMPRESSOR, recommended setting) against the stock strategy: 2 workers, each"
  echo "   behind a $LINK_RATE link, $MODEL on Fashion-MNIST, $EPOCHS epochs at most =="
  "$PYTHON" benchmarks/time_to_accuracy.py --workers 2 --models "$MODEL" --rates "$LINK_RATE" \
    --settings stock "$COMPRESSOR" --floor stock --epochs "$EPOCHS" --budget "$BUDGET" \
    --eval_every 5 \
    --out "$out/time_to_accuracy" > "$out/time_to_accuracy.log"
  "$PYTHON" - "$out/time_to_accuracy.json" "$COMPRESSOR" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
runs = [r for r in report["runs"] if r["role"] == "run"]
floor = next(r for r in report["runs"] if r["role"] == "floor")
if floor.get("status") != "ok":
    sys.exit(f"the floor run failed: {floor.get('reason')}")
print(f"\ntarget: test accuracy {floor['target']:.4f} (stock on a fast link ended at "
      f"{floor['final_accuracy']:.4f}; minus 0.5 point)")
print(f"{'run':<34} {'time to target':>18} {'steps':>6} {'step ms':>8} {'sent/step':>11} "
      f"{'final acc':>9}")
for r in runs:
    if r.get("status") != "ok":
        print(f"{r['setting']:<34} failed: {r.get('reason')}")
        continue
    name = ("stock MultiWorkerMirroredStrategy" if r["setting"] == "stock"
            else r["compressor"])
    tta = (f"{r['time_to_target_s']:.0f} s" if r["reached"]
           else f"not in {r['train_s']:.0f} s")
    steps = r["steps_to_target"] if r["reached"] else r["steps"]
    print(f"{name[:34]:<34} {tta:>18} {steps:>6} {r['median_step_ms']:>8.0f} "
          f"{r['sent_bytes_per_step'] / 1e3:>8.1f} kB {r['final_accuracy']:>9.4f}")
mine = next((r for r in runs if r["setting"] != "stock" and r.get("status") == "ok"), None)
if mine and mine.get("speedup_vs_stock"):
    kind = mine.get("speedup_vs_stock_kind")
    print(f"\ntfgc reached the target {mine['speedup_vs_stock']:.1f}x sooner than the stock "
          f"strategy{' (projected: see the table)' if kind == 'projected' else ''}.")
PY
  echo
  echo "written to $out: time_to_accuracy.md (the table), time_to_accuracy_*.svg (test accuracy"
  echo "against training time), time_to_accuracy.json, time_to_accuracy.log"
  exit 0
fi

echo "link not shaped: $why; running over loopback, where the link does not limit a step"
common=(--workers=2 --dataset=fashion_mnist --model="$MODEL" --epochs="$EPOCHS" --timeout=1800
        --recommended --eval_each_epoch)
echo "== tfgc: $COMPRESSOR (recommended setting), 2 workers, $MODEL on Fashion-MNIST =="
"$PYTHON" -m tfgc.apps.train "${common[@]}" --compressor="$COMPRESSOR" --json_out="$out/tfgc.json" \
  | grep -v '^\[w0\] RESULT '
echo "== stock MultiWorkerMirroredStrategy, same model and data =="
"$PYTHON" -m tfgc.apps.train "${common[@]}" --baseline --json_out="$out/baseline.json" \
  | grep -v '^\[w0\] RESULT '

"$PYTHON" - "$out" <<'PY'
import json, os, sys
from tfgc.apps.plots import svg_plot
out = sys.argv[1]
runs = [json.load(open(os.path.join(out, f))) for f in ("tfgc.json", "baseline.json")]
print()
print("bytes per worker and step; 'sent' is what crosses a worker's link")
print(f"{'run':<28} {'test acc':>8} {'payload':>10} {'sent':>10} {'wire ratio':>10} {'step ms':>8}")
for r in runs:
    r["label"] = "stock MWMS" if r["baseline"] else r["compressor"]
    print(f"{r['label']:<28} {r['test_accuracy']:>8.4f} {r['payload_bytes_per_step']:>10,} "
          f"{r['sent_bytes_per_step']:>10,} {r['wire_ratio']:>9.1f}x {r['step_time_ms']:>8.2f}")
for key, xlabel, xlog, fname in (
        ("cumulative_sent_bytes", "bytes sent per worker (cumulative, log scale)", True,
         "accuracy_vs_bytes.svg"),
        ("train_seconds", "training time, s (evaluation left out)", False,
         "accuracy_vs_time.svg")):
    series = [(r["label"], [(p[key], p["test_accuracy"]) for p in r["curve"] if p[key] > 0])
              for r in runs]
    with open(os.path.join(out, fname), "w") as f:
        f.write(svg_plot("Fashion-MNIST, 2 workers: test accuracy after each epoch", xlabel,
                         "test accuracy", series, xlog))
print()
print(f"written to {out}: accuracy_vs_bytes.svg, accuracy_vs_time.svg, tfgc.json, baseline.json")
PY
