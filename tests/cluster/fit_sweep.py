"""A cluster worker for the distributed tests: trains once per compressor, saves results.

Run under tfgc.launch (TF_CONFIG set). One strategy serves every compressor: the
strategy's compressor is switched between runs, and each run builds a fresh model,
so its train function is traced with that compressor.

Usage: fit_sweep.py OUT_DIR DATASET EPOCHS SPEC [SPEC ...]
Writes OUT_DIR/<i>.w<rank>.npz (final weights) and OUT_DIR/<i>.w<rank>.json.
"""

import json
import os
import sys

import numpy as np


def main(out_dir, dataset, epochs, specs):
    import tfgc
    from tfgc import data as data_lib
    from tfgc.train import train_and_evaluate

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=specs[0])
    ds = data_lib.load_dataset(dataset, seed=0)
    for i, spec in enumerate(specs):
        strategy.compressor = spec
        before = strategy.compression_stats()
        results, net = train_and_evaluate(
            strategy, model="mlp", data=ds, epochs=epochs, batch_size=32,
            learning_rate=_lr(spec), optimizer=_opt(spec), seed=0, verbose=0)
        after = strategy.compression_stats()
        results["spec"] = spec
        results["reductions"] = after["steps"] - before["steps"]
        results["state_slots"] = len(strategy.compression_state())
        rank = results["rank"]
        np.savez(os.path.join(out_dir, f"{i}.w{rank}.npz"), *[w.numpy() for w in net.weights])
        with open(os.path.join(out_dir, f"{i}.w{rank}.json"), "w") as f:
            json.dump(results, f)
        print(f"done {spec}: accuracy {results['test_accuracy']:.4f} ratio {results['ratio']:.1f}",
              flush=True)


def _opt(spec):
    return "sgd" if "signsgd" in spec else "momentum"


def _lr(spec):
    # Majority-vote signSGD moves every coordinate by the full step: a smaller one.
    return 0.002 if spec == "signsgd" else 0.05


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
