"""Pure-TF packing of small unsigned codes into int32 words, and dtype <-> word casts.

TensorFlow's CPU collectives gather float and int32/int64 tensors but not uint8, so
every payload crosses the wire as int32 words: 4-byte dtypes are bitcast directly,
2-byte dtypes in pairs, 1-byte dtypes in fours, and b-bit codes (b dividing 32) are
packed 32/b to a word, least significant field first.
"""

import tensorflow as tf

_WORD_BITS = 32


def packed_words(num_codes: int, bits: int) -> int:
    per_word = _WORD_BITS // bits
    return -(-num_codes // per_word)


def pack_codes(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """Packs a 1-D tensor of codes in [0, 2**bits) into int32 words.

    Code ``i`` lands in word ``i // (32 // bits)`` at bit offset ``bits * (i % (32 // bits))``.
    Padding fields are zero.
    """
    if _WORD_BITS % bits:
        raise ValueError(f"`bits` must divide 32, got {bits}")
    per_word = _WORD_BITS // bits
    n = int(codes.shape[0])
    words = packed_words(n, bits)
    codes = tf.cast(tf.reshape(codes, [-1]), tf.uint32)
    codes = tf.pad(codes, [[0, words * per_word - n]])
    codes = tf.reshape(codes, [words, per_word])
    shifts = tf.constant([bits * j for j in range(per_word)], dtype=tf.uint32)
    # Fields never overlap, so summing the shifted codes is a bitwise OR.
    packed = tf.reduce_sum(tf.bitwise.left_shift(codes, shifts), axis=1)
    return tf.bitcast(packed, tf.int32)


def unpack_codes(words: tf.Tensor, num_codes: int, bits: int) -> tf.Tensor:
    """Inverse of ``pack_codes``: returns ``num_codes`` uint32 codes."""
    per_word = _WORD_BITS // bits
    expected = packed_words(num_codes, bits)
    tf.debugging.assert_equal(tf.size(words), expected,
                              message="packed payload has the wrong number of words")
    words = tf.bitcast(tf.reshape(words, [-1]), tf.uint32)
    shifts = tf.constant([bits * j for j in range(per_word)], dtype=tf.uint32)
    mask = tf.constant((1 << bits) - 1 if bits < 32 else 0xFFFFFFFF, dtype=tf.uint32)
    fields = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[:, None], shifts), mask)
    return tf.reshape(fields, [-1])[:num_codes]


def to_words(t: tf.Tensor) -> tf.Tensor:
    """Bitcasts a tensor of any 1, 2, 4 or 8-byte dtype into int32 words (zero padded)."""
    if t.shape.rank != 1:
        t = tf.reshape(t, [-1])
    size = t.dtype.size
    if t.dtype == tf.int32:
        return t
    if size == 4:
        return tf.bitcast(t, tf.int32)
    if size == 8:
        return tf.reshape(tf.bitcast(t, tf.int32), [-1])
    if size not in (1, 2):
        raise ValueError(f"cannot pack dtype {t.dtype.name} into int32 words")
    per_word = 4 // size
    n = int(t.shape[0])
    pad = (-n) % per_word
    if pad:
        t = tf.pad(t, [[0, pad]])
    return tf.bitcast(tf.reshape(t, [-1, per_word]), tf.int32)


def num_words(num_values: int, dtype: tf.DType) -> int:
    return -(-num_values * dtype.size // 4)


def from_words(words: tf.Tensor, dtype: tf.DType, num_values: int) -> tf.Tensor:
    """Inverse of ``to_words`` (no slice where ``words`` hold exactly ``num_values``)."""
    if dtype == tf.int32:
        values = words
    elif dtype.size == 4:
        values = tf.bitcast(words, dtype)
    else:
        values = tf.reshape(tf.bitcast(words, dtype), [-1])
    if values.shape.rank == 1 and values.shape[0] == num_values:
        return values
    return values[:num_values]
