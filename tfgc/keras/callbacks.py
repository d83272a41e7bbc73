"""Callbacks that put compression statistics into Keras logs and the progress bar."""

import tf_keras as keras


class CompressionStatsCallback(keras.callbacks.Callback):
    """Adds this worker's communication figures to the logs of every batch and epoch.

    Keys (so ``model.fit`` prints them and ``History`` records them):

    * ``sent_MB``: megabytes (1e6) this worker put on the wire for the last gradient
      reduction (the ring all-reduce or all-gather of its payloads);
    * ``dense_sent_MB``: what the stock dense ring all-reduce sends for the same
      gradients on the same number of workers;
    * ``ratio``: compression of the payload (dense gradients / payload);
    * ``wire_ratio``: dense_sent_MB / sent_MB.

    ``strategy.compression_stats()`` has the rest (received bytes, payload bytes,
    totals, steps skipped for non-finite gradients).

    The callback reads three variables per batch; pass ``every_n_batches`` to read
    less often. The progress bar averages nothing: it shows the last step's figures.
    """

    def __init__(self, strategy, every_n_batches: int = 1, prefix: str = ""):
        super().__init__()
        if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) \
                or every_n_batches < 1:
            raise ValueError(f"`every_n_batches` must be an integer >= 1, got {every_n_batches!r}")
        if not hasattr(strategy, "compression_stats"):
            raise ValueError("`strategy` must be a tfgc.CompressedMultiWorkerMirroredStrategy, "
                             f"got {type(strategy).__name__}")
        self._strategy = strategy
        self._every = every_n_batches
        self._prefix = prefix
        self._last = None

    def _figures(self):
        stats = self._strategy.compression_stats()
        p = self._prefix
        return {f"{p}sent_MB": stats["sent_bytes"] / 1e6,
                f"{p}dense_sent_MB": stats["dense_sent_bytes"] / 1e6,
                f"{p}ratio": stats["ratio"],
                f"{p}wire_ratio": stats["wire_ratio"]}

    def on_train_batch_end(self, batch, logs=None):
        if logs is None:
            return
        if self._last is None or batch % self._every == 0:
            self._last = self._figures()
        logs.update(self._last)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            self._last = self._figures()
            logs.update(self._last)
