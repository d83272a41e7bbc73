"""Distributed datasets whose iterators are torn down off the thread that drops them.

Why: under a multi-worker strategy every iterator of a distributed dataset runs its
worker's pipeline through a ``MultiDeviceIterator``: the host pipeline and one pipeline
per device, each with a tf.data autotuning thread that sleeps between optimizations for
a period that doubles. Deleting the iterator cancels those threads and joins them. A
thread woken by the cancellation can go back to sleep for the rest of its period
(TensorFlow marks a cancellation done only after its callbacks have run, and the thread
checks for it as it wakes), so the deletion can take seconds.

Measured on TensorFlow 2.21, 2 workers on a 2-core machine, MLP fits of 156 steps
(``tests/cluster/fit_sweep.py``): in a third to a half of fits ``model.fit`` returned
0.7-6 s (once 13.6 s) after its last step, on one worker, while its peer waited for it
in the next collective. TensorFlow's log (``TF_CPP_VMODULE=model=2``) showed the host
pipeline's autotuning thread logging a new wait, "Waiting for 1511 ms", at the moment of
the deletion, and ``fit`` returned 1.51 s later. Turning autotuning off on the dataset
removes the host pipeline's thread, not the device pipelines' ones, which tf.distribute
builds with default options. With the teardown moved off the caller's thread, the
2-worker sweep of ``tests/test_distributed.py`` took 134 s instead of 172 s.

So the iterators made from a dataset that ``distribute`` wraps hand their resources,
when the iterator itself is dropped, to a thread of their own that drops them there.
The resources are released no earlier than before, and nothing waits for them. The
thread is not a daemon: an interpreter that exits waits for it, as it waited for the
deletion before.
"""

import threading
import weakref

from absl import logging

# One subclass per distributed dataset class (``DistributedDataset``,
# ``DistributedDatasetsFromFunction``).
_SUBCLASSES = {}
_LOCK = threading.Lock()


def _release(parts):
    """Runs as ``parts``' iterator is deleted, before its attributes are: takes the
    workers' iterators out of that list (else the deletion would drop the last
    reference to them in place) and drops them on a thread of its own."""
    held = list(parts)
    parts.clear()
    try:
        threading.Thread(target=held.clear, name="tfgc-iterator-release").start()
    except RuntimeError:  # the interpreter is shutting down: dropped in place
        held.clear()


def _held(iterator):
    """``iterator``, whose workers' iterators are dropped by ``_release`` when it is.
    Iterators without that list (another TensorFlow's layout) are returned as they
    are."""
    parts = getattr(iterator, "_iterators", None)
    if not isinstance(parts, list) or not parts:
        return iterator
    try:
        finalizer = weakref.finalize(iterator, _release, parts)
    except TypeError:  # not weakly referable: released in place
        return iterator
    finalizer.atexit = False  # an iterator alive at exit is left to the interpreter
    return iterator


def _subclass(cls):
    with _LOCK:
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            def __iter__(self):  # pylint: disable=invalid-name
                return _held(cls.__iter__(self))

            sub = type(cls.__name__, (cls,), {"__iter__": __iter__,
                                              "__module__": cls.__module__,
                                              "__doc__": cls.__doc__})
            _SUBCLASSES[cls] = sub
        return sub


def distribute(dataset):
    """``dataset`` (a distributed dataset) made to hand each iterator's teardown to a
    thread of its own (see the module docstring); unchanged where that cannot be done."""
    if type(dataset) in _SUBCLASSES.values():
        return dataset
    try:
        dataset.__class__ = _subclass(type(dataset))
    except TypeError as exc:
        logging.vlog(1, "tfgc: %s iterators are released in place: %s",
                     type(dataset).__name__, exc)
    return dataset
