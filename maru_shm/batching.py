"""When a batch is small: the one rule by which every batch path of the store picks its form.

A numpy call costs a few microseconds whatever its length, which only pays off over many keys: a batch of
at most SMALL_BATCH keys or blocks takes the scalar form (plain Python per key), a larger one the vector
form (one numpy operation over the batch). The allocator, the read path, the write path and the publisher
all decide by it.
"""

SMALL_BATCH = 8
