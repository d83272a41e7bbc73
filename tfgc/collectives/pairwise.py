"""Two-worker subgroups of the collective group, for butterflies.

TensorFlow's CPU collectives have no all-to-all, reduce-scatter or point-to-point
send, but any set of workers that issue a collective with the same group key and
group size forms a group. A group of two is a pairwise exchange: both members
all-gather one tensor each and read the other's half. Recursive doubling (and
halving) is built from such exchanges, partner ``rank ^ 2**s`` at stage s.

Each pair has a group key derived from its two ranks and the index of its strategy in
the process (``keys_index``: a second strategy's pairs must not meet the first one's
instances in the runtime), so that every worker names the same pair the same way
without agreeing on an order of creation, and a
``CollectiveReplicaLauncher`` of its own, whose instance keys come from a
``CollectiveKeys`` that knows only the pair groups of this replica.
"""

import threading

import tensorflow as tf
from tensorflow.python.distribute import cross_device_utils

from tfgc.collectives.allgather import all_gather

# Far above the group keys MultiWorkerMirroredStrategy hands out (it counts up
# from 1 per set of devices), so a pair never takes the key of a strategy group.
_PAIR_KEY_BASE = 1 << 24


class _PairKeys(cross_device_utils.CollectiveKeys):
    """Collective keys for pair groups: the group key is a function of the pair."""

    def pair_group_key(self, a: int, b: int, num_ranks: int, device: str,
                       keys_index: int = 0) -> int:
        lo, hi = min(a, b), max(a, b)
        key = _PAIR_KEY_BASE + (keys_index * num_ranks + lo) * num_ranks + hi
        with self._lock:
            group = self._instance_key_table.setdefault(key, {})
            group.setdefault(device, cross_device_utils.INSTANCE_KEY_START_NUMBER)
        return key


class PairExchanger:
    """Pairwise exchanges between this replica and any other replica of the group.

    Args:
      rank: this replica's rank among all ``num_ranks`` replicas.
      num_ranks: the size of the whole collective group.
      device: this replica's device.
      options: ``tf.distribute.experimental.CommunicationOptions``.
      keys_index: which of the process's strategies the exchanges serve (1, 2, ... in
        the order they were built, the same on every worker; 0 outside a strategy):
        each has pair group keys of its own.
    """

    def __init__(self, rank: int, num_ranks: int, device: str, options, keys_index: int = 0):
        if isinstance(keys_index, bool) or int(keys_index) != keys_index or keys_index < 0:
            raise ValueError(f"keys_index must be an integer >= 0, got {keys_index!r}")
        if _PAIR_KEY_BASE + (keys_index + 1) * num_ranks * num_ranks > 2 ** 31 - 1:
            raise ValueError(f"keys_index {keys_index} with {num_ranks} ranks leaves the "
                             "int32 range of collective group keys")
        self._keys_index = int(keys_index)
        self._rank = rank
        self._num_ranks = num_ranks
        self._device = device
        self._options = options
        self._keys = _PairKeys()
        self._launchers = {}
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self._rank

    def _launcher(self, partner: int):
        with self._lock:
            if partner not in self._launchers:
                key = self._keys.pair_group_key(self._rank, partner, self._num_ranks,
                                                self._device, self._keys_index)
                self._launchers[partner] = cross_device_utils.CollectiveReplicaLauncher(
                    key, 2, self._keys, self._device, self._options)
            return self._launchers[partner]

    def exchange(self, partner: int, tensor: tf.Tensor) -> tf.Tensor:
        """Sends ``tensor`` to ``partner`` and returns the partner's tensor of the same shape.

        Both sides must call it with tensors of one shape (dynamic shapes are fine
        when both agree at run time). Each side tags its half with its rank, so the
        partner's half is found whatever order the runtime gives the two members.
        """
        if partner == self._rank:
            raise ValueError("a replica cannot exchange with itself")
        flat = tf.reshape(tensor, [-1])
        words = tf.concat([tf.constant([self._rank], tf.int32),
                           _as_words(flat)], axis=0)
        both = tf.reshape(all_gather(self._launcher(partner), words, self._options), [2, -1])
        theirs = tf.where(tf.equal(both[0, 0], self._rank), 1, 0)
        return tf.reshape(_from_words(tf.gather(both, theirs)[1:], tensor.dtype), tf.shape(tensor))


def _as_words(t: tf.Tensor) -> tf.Tensor:
    if t.dtype == tf.int32:
        return t
    if t.dtype.size != 4:
        raise ValueError(f"pairwise exchange carries 4-byte dtypes, got {t.dtype.name}")
    return tf.bitcast(t, tf.int32)


def _from_words(words: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return words if dtype == tf.int32 else tf.bitcast(words, dtype)
