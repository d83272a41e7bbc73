"""All-gather of packed payloads: many tensors' payloads share one collective."""

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from tfgc.ops import packing


def all_gather(launcher, tensor: tf.Tensor, options) -> tf.Tensor:
    """Every member's ``tensor``, concatenated along axis 0 in rank order.

    The one use of the launcher's private ``_all_gather`` in tfgc. The public
    ``all_gather`` of TensorFlow 2.21 first all-gathers the shapes (a second collective
    per call) and refuses eager mode; tfgc's payloads have static shapes, known to
    every member, and its settings exchange runs eagerly.
    """
    return launcher._all_gather(tensor, options)  # pylint: disable=protected-access


def payload_words(payload: Sequence[tf.Tensor]) -> tf.Tensor:
    """Packs a payload (tensors of any 1, 2 or 4-byte dtype) into one int32 word vector."""
    return tf.concat([packing.to_words(t) for t in payload], axis=0)


def num_payload_words(payload: Sequence[tf.Tensor]) -> int:
    """Length of ``payload_words(payload)``; ``payload`` may hold tensors or TensorSpecs."""
    return sum(packing.num_words(int(t.shape.num_elements()), t.dtype) for t in payload)


def padded_payload_words(payload: Sequence[tf.Tensor], width: int) -> tf.Tensor:
    """``payload_words(payload)`` padded with zeros to ``width`` words."""
    words = payload_words(payload)
    return tf.pad(words, [[0, width - int(words.shape[0])]])


def split_words(words: tf.Tensor, widths: Sequence[int]) -> List[tf.Tensor]:
    """``words`` (a vector of static length at least ``sum(widths)``) cut into pieces of
    ``widths`` words, what follows them left out: one split op where slices would take
    several ops each (a traced step unpacks every worker's payload of every gradient)."""
    rest = int(words.shape[0]) - sum(widths)
    if rest < 0:
        raise ValueError(f"{int(words.shape[0])} words cannot hold pieces of {sum(widths)}")
    pieces = list(widths) + ([rest] if rest else [])
    return ([words] if len(pieces) == 1 else tf.split(words, pieces))[:len(widths)]


def unpack_payload_words(words: tf.Tensor, like) -> Tuple[tf.Tensor, ...]:
    """Splits a word vector (padding after the payload is ignored) into tensors shaped like
    ``like`` (tensors or TensorSpecs)."""
    sizes = [int(t.shape.num_elements()) for t in like]
    widths = [packing.num_words(n, t.dtype) for n, t in zip(sizes, like)]
    if words.shape.rank != 1 or words.shape[0] is None:  # not static: slices
        offsets = [sum(widths[:k]) for k in range(len(widths))]
        parts = [words[o:o + w] for o, w in zip(offsets, widths)]
    else:
        parts = split_words(words, widths)
    return tuple(_shaped(packing.from_words(part, t.dtype, n), t.shape)
                 for part, t, n in zip(parts, like, sizes))


def _shaped(values: tf.Tensor, shape) -> tf.Tensor:
    """``values`` reshaped to ``shape``: no op where the static shapes already agree (a
    traced step unpacks every worker's payload of every gradient)."""
    if values.shape.is_fully_defined() and values.shape == shape:
        return values
    return tf.reshape(values, shape)


def gather_payloads(launcher, payloads: List[Sequence[tf.Tensor]], num_workers: int, options,
                    bucket_bytes: int, control: Optional[tf.Tensor] = None):
    """Exchanges every worker's payloads.

    Args:
      launcher: the replica's ``CollectiveReplicaLauncher``.
      payloads: this worker's payloads, one tuple of static-shape tensors per gradient.
      num_workers: the collective group size.
      options: ``tf.distribute.experimental.CommunicationOptions``.
      bucket_bytes: payloads are fused into all-gathers of at most this many bytes
        per worker (a single payload larger than that gets a bucket of its own).
      control: an optional short int32 vector (flags, counters) that rides at the
        end of the first bucket instead of taking a collective of its own.

    Returns:
      ``(payloads, control)``: for each gradient, the list of all workers' payloads
      in group-rank order; and every worker's control vector, ``[num_workers, k]``
      (None without ``control``).
    """
    for payload in payloads:
        for t in payload:
            if not t.shape.is_fully_defined():
                raise ValueError(
                    f"all-gather needs payloads of static shape, got {t.shape} ({t.dtype.name}); "
                    "a compressor with data-dependent payload sizes needs a padded exchange")
    words = [payload_words(p) for p in payloads]
    sizes = [int(w.shape[0]) for w in words]
    buckets, current, current_bytes = [], [], 0
    for i, size in enumerate(sizes):
        if current and current_bytes + 4 * size > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += 4 * size
    if current:
        buckets.append(current)

    results = [None] * len(payloads)
    gathered_control = None
    for b, bucket in enumerate(buckets):
        parts = [words[i] for i in bucket]
        if b == 0 and control is not None:
            parts.append(tf.reshape(control, [-1]))
        buffer = tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
        total = int(buffer.shape[0])
        gathered = tf.reshape(all_gather(launcher, buffer, options), [num_workers, total])
        # Each worker's row cut into its gradients' words (and the control words).
        rows = [split_words(row, [sizes[i] for i in bucket])
                for row in tf.unstack(gathered, num=num_workers)]
        for k, i in enumerate(bucket):
            results[i] = [unpack_payload_words(row[k], payloads[i]) for row in rows]
        if b == 0 and control is not None:
            gathered_control = gathered[:, sum(sizes[i] for i in bucket):]
    return results, gathered_control
