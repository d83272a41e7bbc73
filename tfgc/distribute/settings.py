"""The compression settings every worker must share, as one line, and their check.

Before the first compressed reduction of each compressor the workers all-gather this
line (``CompressedAllReduce._exchange_settings``) and stop with a message naming both
sides when two differ: a worker started with another compressor, policy or version of
tfgc or TensorFlow would otherwise combine payloads it cannot read.
"""

import hashlib

import numpy as np
import tensorflow as tf

from tfgc.compressors import serialize_config

# int32 words of the line on the wire (1 KiB); a longer line keeps its head and a digest.
WORDS = 256


def line(compressor, policy, communication: str, bucket_bytes: int,
         overlap_bytes: int) -> str:
    """What every worker must agree on, as one line (the buckets' plan depends on
    ``overlap_bytes``: workers that cut a step differently would pair the wrong
    collectives)."""
    import tfgc
    return (f"tfgc {tfgc.__version__}, tensorflow {tf.__version__}, compressor "
            f"{serialize_config(compressor)}, policy {policy.get_config()}, "
            f"communication {communication}, bucket_bytes {bucket_bytes}, "
            f"overlap_bytes {overlap_bytes}")


def encode(text: str) -> np.ndarray:
    """The line as ``WORDS`` int32 words, NUL-padded; a longer one ends in its SHA-1."""
    raw = text.encode()
    if len(raw) > 4 * WORDS:
        digest = hashlib.sha1(raw).hexdigest().encode()
        raw = raw[:4 * WORDS - len(digest) - 4] + b" ..." + digest
    return np.frombuffer(raw.ljust(4 * WORDS, b"\0"), dtype=np.int32)


def check_agree(table: np.ndarray):
    """Raises ValueError naming both lines if the gathered rows ([replicas, WORDS]) differ."""
    everyone = [bytes(row.tobytes()).rstrip(b"\0").decode(errors="replace") for row in table]
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(
                "tfgc: the workers' compression settings differ; every worker must run "
                f"the same compressor, policy and versions.\n  replica 0: {everyone[0]}"
                f"\n  replica {rank}: {theirs}")
