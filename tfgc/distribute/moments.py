"""Second moments of per-sample gradients, carried next to the gradients.

Variance-based compression (Tsuzuku et al. 2018) needs, for every entry of a
kernel's gradient, the sum over the minibatch of the squared per-sample gradients,
and Keras computes only their mean. Layers that can produce the sum cheaply
(``tfgc.keras.MomentDense``) hold a *moment probe*: a variable shaped like the
kernel that the forward pass ignores and whose "gradient" is that sum, so it
travels down the same ``tape.gradient`` -> optimizer -> all-reduce path as the
kernel's gradient. The cross-device ops pair each probe's gradient with its
kernel's, hand it to the compressor (``CompressContext.second_moment``) and send
nothing for the probe itself: the optimizer sees a zero gradient, which moves no
optimizer of Keras's.

This module only keeps the pairing, keyed like the state store.
"""

import threading

from tfgc.distribute.state import var_key

_LOCK = threading.Lock()
# probe key -> kernel key
_PROBES = {}


def register_probe(probe, kernel):
    """Declares ``probe`` the moment probe of ``kernel``."""
    with _LOCK:
        _PROBES[var_key(probe)] = var_key(kernel)


def kernel_key_of(var):
    """The key of the kernel ``var`` is the probe of, or None if it is no probe."""
    if var is None:
        return None
    with _LOCK:
        return _PROBES.get(var_key(var))
