"""A cluster worker for the killed-worker test, run under ``tfgc-launch --restarts 1``.

Trains the MLP on MNIST-5k with ``ef+topk`` and Keras's ``BackupAndRestore``
(a backup every SAVE_FREQ batches). On the first start, worker 1 kills itself with
SIGKILL mid-epoch; the launcher restarts the cluster, BackupAndRestore restores
the model, the optimizer and (through the optimizer) every worker's compression
state, and training finishes. Each worker writes:

* ``backups.w<rank>.a<attempt>.json``: its residual norms right after each backup;
* ``restored.w<rank>.json``: the residual norms it restored, and the batch it
  resumed at;
* ``final.w<rank>.npz`` and ``final.w<rank>.json``: its final weights and figures.
"""

import json
import os
import signal
import sys

import numpy as np

SAVE_FREQ = 5
KILL_AT = (0, 12)  # (epoch, batch) at which worker 1 dies on the first start
STEPS = 20
EPOCHS = 2


def main():
    out_dir = sys.argv[1]
    attempt = int(os.environ.get("TFGC_RESTART_COUNT", "0"))
    import tf_keras as keras

    import tfgc
    from tfgc.apps import data as data_lib
    from tfgc.apps import models
    from tfgc.apps.train import worker_info

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="ef+topk:ratio=0.01")
    rank, n = worker_info(strategy)
    ds = data_lib.load_dataset("mnist5k", seed=0)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, n)
    train = data_lib.make_tf_dataset(x, y, 32, seed=rank, repeat=True)
    with strategy.scope():
        net = models.build_model("mlp", seed=0)
        net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    backups, seen = {}, {"epoch": 0, "batches": 0}

    def norms():
        return strategy.compression_state(net.optimizer).residual_norms()

    class Recorder(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen["epoch"] = epoch

        def on_train_batch_end(self, batch, logs=None):
            seen["batches"] += 1
            state = strategy.compression_state(net.optimizer)
            if seen["batches"] == 1 and state.last_restore:
                with open(os.path.join(out_dir, f"restored.w{rank}.json"), "w") as f:
                    json.dump({"norms": state.last_restore, "epoch": seen["epoch"],
                               "batch": int(batch)}, f)
            if (batch + 1) % SAVE_FREQ == 0:
                # BackupAndRestore, listed first, has just saved this batch.
                backups[f"{seen['epoch']}/{batch}"] = norms()
                with open(os.path.join(out_dir, f"backups.w{rank}.a{attempt}.json"), "w") as f:
                    json.dump(backups, f)
            if attempt == 0 and rank == 1 and (seen["epoch"], batch) == KILL_AT:
                print(f"worker {rank}: killing myself at epoch {seen['epoch']} batch {batch}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    backup = keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"),
                                              save_freq=SAVE_FREQ)
    net.fit(train, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0, callbacks=[backup, Recorder()])
    np.savez(os.path.join(out_dir, f"final.w{rank}.npz"), *[w.numpy() for w in net.weights])
    with open(os.path.join(out_dir, f"final.w{rank}.json"), "w") as f:
        json.dump({"attempt": attempt, "batches_run": seen["batches"],
                   "optimizer_iterations": int(net.optimizer.iterations.numpy()),
                   "norms": norms()}, f)


if __name__ == "__main__":
    main()
